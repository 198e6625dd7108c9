"""Who holds what under tensor and pipeline parallelism, and the collectives between them.

Ranks are laid out as vLLM does: rank = stage * tp + tp_rank, so rank 0 (the driver,
which also schedules and samples) is tensor rank 0 of the first pipeline stage.

Process groups are gloo (CPU) or NCCL (CUDA) groups built on our own TCP store rather
than torch.distributed's global default group, so an engine never collides with a
process group its host program already set up.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.errors import ParamError


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` contiguous ranges over n items, sizes differing by at most one."""
    return n * i // parts, n * (i + 1) // parts


@dataclass(frozen=True)
class Heads:
    """One tensor rank's attention heads: global [q_lo, q_hi) and [kv_lo, kv_hi)."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def num_q(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def num_kv(self) -> int:
        return self.kv_hi - self.kv_lo


def split_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> Heads:
    """KV heads (with their query groups) are split over the ranks; with fewer KV heads than
    ranks each rank takes a slice of the query heads and the KV heads they read, so KV
    heads are replicated, as in vLLM. Splits need not be even: SmolLM2-135M has 9 query
    and 3 KV heads, and at tp=2 its ranks take 1 and 2 KV groups."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        lo, hi = split(num_kv_heads, tp, rank)
        heads = Heads(lo * group, hi * group, lo, hi)
    else:
        if num_heads < tp:
            raise ParamError("tensor_parallel_size",
                             f"tensor_parallel_size ({tp}) exceeds the model's {num_heads} attention heads")
        q_lo, q_hi = split(num_heads, tp, rank)
        heads = Heads(q_lo, q_hi, q_lo // group, (q_hi - 1) // group + 1)
    # The kernels map local query head j to local KV head j // (num_q / num_kv): the split
    # must keep that true.
    if heads.num_q % heads.num_kv or any(
        (heads.q_lo + j) // group - heads.kv_lo != j // (heads.num_q // heads.num_kv) for j in range(heads.num_q)
    ):
        raise ParamError("tensor_parallel_size", f"{num_heads} query heads over {num_kv_heads} KV heads cannot be "
                         f"split over {tp} ranks; pick a size that divides the heads")
    return heads


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def layers(self, num_layers: int) -> tuple[int, int]:
        if num_layers < self.pp:
            raise ParamError("pipeline_parallel_size",
                             f"pipeline_parallel_size ({self.pp}) exceeds the model's {num_layers} layers")
        return split(num_layers, self.pp, self.stage)

    def cores(self, available: list[int]) -> list[int] | None:
        """This rank's share of the CPU cores; None when there are fewer cores than ranks."""
        if len(available) < self.world:
            return None
        lo, hi = split(len(available), self.world, self.rank)
        return available[lo:hi]


def max_kv_heads(config, tp: int) -> int:
    kv = config.num_key_value_heads or config.num_attention_heads
    return max(split_heads(config.num_attention_heads, kv, tp, r).num_kv for r in range(tp))


def max_layers(num_layers: int, pp: int) -> int:
    Layout(1, pp).layers(num_layers)  # the size check
    return max(hi - lo for lo, hi in (split(num_layers, pp, s) for s in range(pp)))


@dataclass
class Group:
    """A process group and this process's rank in it; collectives on CPU tensors (gloo)
    or the group's device (NCCL)."""

    pg: object | None = None
    rank: int = 0
    size: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])  # global rank of each member

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.pg.allreduce([x]).wait()
        return x

    def send(self, x: torch.Tensor, to: int) -> object:
        """Start sending to member `to`; wait on the result before touching x again."""
        return self.pg.send([x], to, 0)

    def recv(self, x: torch.Tensor, src: int) -> None:
        self.pg.recv([x], src, 0).wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Dist:
    """This process's groups: `control` (gloo, CPU tensors) for the driver's step messages,
    `world` (the device's backend) for pipeline activations and logits, `tp` for the
    tensor-parallel collectives of its stage. On the CPU control and world are one group."""

    layout: Layout
    control: Group
    world: Group
    tp: Group


def single() -> Dist:
    return Dist(Layout(), Group(), Group(), Group())


def connect(layout: Layout, port: int, backend: str, timeout_s: float,
            waiting: Callable[[], None] | None = None) -> Dist:
    """Join the engine's groups (every rank calls this; rank 0 hosts the store).

    Forming a group blocks until every rank joins or the timeout passes, so rank 0 first
    waits for each worker to check in at the store, calling `waiting` meanwhile: a worker
    that dies before joining (`waiting` raises) fails the start at once, not at the timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = open_store(port, layout.world, layout.rank == 0, timeout)
    if layout.rank != 0:
        store.set(f"joining/{layout.rank}", "1")
    else:
        keys = [f"joining/{r}" for r in range(1, layout.world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if waiting is not None:
                waiting()
            if time.monotonic() > deadline:
                raise TimeoutError(f"parallel workers did not join within {timeout_s:.0f}s")
            time.sleep(0.05)
    everyone = list(range(layout.world))
    world = Group(_make(backend, store, layout.rank, layout.world, timeout), layout.rank, layout.world, everyone)
    control = world
    if backend != "gloo":
        control = Group(_make("gloo", dist.PrefixStore("control", store), layout.rank, layout.world, timeout),
                        layout.rank, layout.world, everyone)
    members = [layout.rank_of(layout.stage, t) for t in range(layout.tp)]
    if layout.pp == 1:
        tp = world
    else:
        sub = dist.PrefixStore(f"tp{layout.stage}", store)
        tp = Group(_make(backend, sub, layout.tp_rank, layout.tp, timeout), layout.tp_rank, layout.tp, members)
    return Dist(layout, control, world, tp)


_listeners: list[socket.socket] = []  # the stores' listening sockets, open as long as the process


def open_store(port: int, world: int, master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """The ranks' rendezvous store on this machine. The master's listens on loopback only:
    given a host, TCPStore's own server still listens on every interface, where anyone who
    reaches the machine could read and write the groups' keys."""
    if not master:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    _listeners.append(sock)
    return dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.fileno())


def _make(backend: str, store, rank: int, size: int, timeout: datetime.timedelta):
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def visible_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))
