"""Where forward passes run: in this process, or over tensor- and pipeline-parallel ranks.

Both executors take steps in order (`submit`) and hand back each step's logits in the
same order (`result`). Only a pipeline has more than one step in flight: `depth` is its
number of stages, as vLLM keeps one scheduler output per stage.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import threading
import time
from collections import deque

import torch
import torch.multiprocessing as tmp

from engine import cuda_graphs, parallel, spawn
from engine.config import EngineConfig, Placement, ResolvedConfig, measures_memory
from engine.errors import EngineDeadError
from engine.models import loader
from engine.runner import HEADER, NOOP, STOP, ModelRunner, StepTensors
from engine.worker import WorkerSpec, build, main

logger = logging.getLogger(__name__)

KEEPALIVE_S = 30.0  # an idle driver says so this often: a worker's receive never times out


class WorkerDiedError(EngineDeadError):
    """A worker process of a parallel engine exited: the engine cannot run another step."""


class LocalExecutor:
    """The model in this process."""

    depth = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[torch.Tensor] = deque()

    def submit(self, step: StepTensors) -> None:
        self._done.append(self.runner.forward(step))

    def weight_bytes(self, hf_config, dtype: torch.dtype) -> int:
        from engine.models import quantize

        return quantize.weight_bytes(self.runner.model) or loader.weight_bytes(hf_config, dtype)

    def result(self) -> torch.Tensor:
        return self._done.popleft()

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class ParallelExecutor:
    """Rank 0 of tp x pp ranks: the workers are torch.multiprocessing children; this process
    runs the first stage's tensor rank 0 itself. A watchdog thread notices a worker's exit
    and stops the others, so nothing waits on a dead peer: every later call raises
    WorkerDiedError."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.layout = lay = parallel.Layout(spec.tp, spec.pp, 0)
        self.depth = spec.pp
        # The ranks rank 0 sends each step to: its stage's other tensor ranks, then the next stage's first.
        self._tp_peers = [lay.rank_of(0, r) for r in range(1, lay.tp)]
        self._next_stage = lay.rank_of(1, 0) if lay.pp > 1 else None
        self.error: str | None = None
        ctx = tmp.get_context("spawn")
        self.procs = [ctx.Process(target=main, args=(r, spec), name=f"engine-rank{r}", daemon=True)
                      for r in range(1, self.layout.world)]
        for p in self.procs:
            spawn.start(p)  # never re-runs the user's script in the worker
        self._closing = False
        self._threads = torch.get_num_threads()  # rank 0 takes only its share of the cores until close
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self.group, self.runner = build(spec, 0, self.check)
            for r in range(1, self.layout.world):  # each worker's ready signal
                self.group.control.recv(torch.empty(1), r)
        except Exception as exc:
            self.close()
            raise WorkerDiedError(self.error or f"parallel workers failed to start: {exc}") from exc
        self._lock = threading.Lock()
        self._inflight: deque[tuple] = deque()
        self._last_send = time.monotonic()
        self._keepalive = threading.Thread(target=self._keep_alive, name="engine-keepalive", daemon=True)
        self._keepalive.start()

    # -- steps --------------------------------------------------------------------
    def submit(self, step: StepTensors) -> None:
        self.check()
        header, body = step.pack()
        control, world, lay = self.group.control, self.group.world, self.layout
        with self._lock, self._failures():
            self._last_send = time.monotonic()
            sends = [(control.send(t, r), t) for r in self._tp_peers for t in (header, body)]
            out = self.runner.forward(step)
            if lay.pp == 1:
                for work, _ in sends:
                    work.wait()
                self._inflight.append((out, None, []))
                return
            rows = step.logits_indices.shape[0]
            nxt = self._next_stage
            sends += [(control.send(header, nxt), header), (control.send(body, nxt), body),
                      (world.send(out, nxt), out)]
            logits = torch.empty(rows, self.spec.hf_config.vocab_size, dtype=torch.float32, device=out.device)
            recv = world.pg.recv([logits], lay.rank_of(lay.pp - 1, 0), 0) if rows else None
            self._inflight.append((logits, recv, sends))

    def result(self) -> torch.Tensor:
        with self._lock, self._failures():
            logits, recv, sends = self._inflight.popleft()
            for work, _ in sends:
                work.wait()
            if recv is not None:
                recv.wait()
            self._last_send = time.monotonic()
            return logits

    def weight_bytes(self, hf_config, dtype: torch.dtype) -> int:
        """Rank 0's share of the weights (quantization is not served in parallel)."""
        return loader.weight_bytes(hf_config, dtype) // self.layout.world

    def check(self) -> None:
        if self.error is not None:
            raise WorkerDiedError(self.error)

    @contextlib.contextmanager
    def _failures(self):
        """A peer that vanished mid-call surfaces as WorkerDiedError naming it."""
        try:
            yield
        except WorkerDiedError:
            raise
        except RuntimeError as exc:
            deadline = time.monotonic() + 2.0  # give the watchdog a moment to name the rank
            while self.error is None and time.monotonic() < deadline:
                time.sleep(0.05)
            raise WorkerDiedError(self.error or f"a parallel rank failed: {exc}") from exc

    # -- liveness -----------------------------------------------------------------
    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        dead = sentinels[ready[0]]
        dead.join(1)
        self.error = f"parallel worker {dead.name} exited (code {dead.exitcode})"
        logger.error("%s; stopping the other ranks", self.error)
        for p in self.procs:  # their sockets close, so this process's pending calls fail too
            if p.is_alive():
                p.kill()

    def _keep_alive(self) -> None:
        while not self._closing and self.error is None:
            time.sleep(KEEPALIVE_S / 4)
            if time.monotonic() - self._last_send < KEEPALIVE_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._inflight and not self._closing and self.error is None:
                    self._broadcast(NOOP)
                    self._last_send = time.monotonic()
            except RuntimeError as exc:  # a dead worker: the watchdog names it; anything else shows here
                logger.warning("keep-alive to the parallel workers failed: %s", exc)
            finally:
                self._lock.release()

    def _broadcast(self, kind: int) -> None:
        """A header for every rank this one feeds; the later stages pass it on."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = kind
        peers = self._tp_peers + ([self._next_stage] if self._next_stage is not None else [])
        for work in [self.group.control.send(header, p) for p in peers]:
            work.wait()

    def close(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        if self.error is None and hasattr(self, "group"):
            try:
                while self._inflight:  # let the pipeline finish what it holds
                    self.result()
                with self._lock:
                    self._broadcast(STOP)
            except RuntimeError as exc:  # the workers are killed below either way
                logger.warning("parallel workers did not stop cleanly: %s", exc)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        torch.set_num_threads(self._threads)


def create_executor(config: EngineConfig, placement: Placement, files: loader.ModelFiles, hf_config,
                    extra_block_bytes: int = 0) -> tuple[LocalExecutor | ParallelExecutor, ResolvedConfig]:
    """In this process for tp = pp = 1, else over worker processes; with the config
    resolved against the model as loaded. The attention backend chosen with the placement
    is built here, once. A KV pool sized from free device memory is sized after this
    process has loaded its weights; the workers' own are counted from the config."""
    backend = placement.attention_backend.load()
    dummy = config.load_format == "dummy"
    fused = backend.fused_kernels()
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        model = loader.build_model(None if dummy else files, hf_config, placement.dtype, placement.device,
                                   max_positions=placement.max_positions, dummy=dummy, seed=config.seed, fused=fused,
                                   quantization=config.quantization, int8_activations=config.int8_activations)
        sizes = cuda_graphs.wanted(config, placement.device, backend, model)
        # the graphs' pool is set aside before the KV pool takes what is free
        reserve = cuda_graphs.pool_bytes(hf_config, sizes[-1], placement.dtype) if sizes else 0
        resolved = ResolvedConfig.resolve(config, hf_config, placement, backend, reserve, extra_block_bytes)
        runner = ModelRunner(model, resolved.num_blocks, config.block_size, resolved.dtype, resolved.device, backend,
                             groups=resolved.kv_groups, state_slots=resolved.state_slots)
        if sizes:
            runner.graphs = cuda_graphs.DecodeGraphs(runner, sizes, -(-resolved.max_model_len // config.block_size))
            runner.graphs.capture_all()
        return LocalExecutor(runner), resolved
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    pending = loader.weight_bytes(hf_config, placement.dtype) // ranks if measures_memory(placement.device) else 0
    resolved = ResolvedConfig.resolve(config, hf_config, placement, backend, pending, extra_block_bytes)
    spec = WorkerSpec(None if dummy else files, hf_config, resolved.dtype, resolved.device.type,
                      resolved.max_positions, resolved.num_blocks, config.block_size, backend,
                      config.seed, config.tensor_parallel_size, config.pipeline_parallel_size,
                      parallel.free_port(), timeout_s=600.0,
                      kv_groups=resolved.kv_groups if config.pipeline_parallel_size == 1 else None)
    return ParallelExecutor(spec), resolved
