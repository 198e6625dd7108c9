"""A worker process of a parallel engine: one rank's model part and KV cache.

Rank 0 (the driver) schedules and samples; a worker only runs forward passes. Each step
arrives from the rank that feeds this one (the driver for the first stage's other tensor
ranks, the same tensor rank of the previous stage otherwise) as a header and a packed
StepTensors, plus the activations on a later pipeline stage. A worker exits on any error:
its sockets close, so every rank waiting on it fails at once instead of hanging.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import parallel
from engine.kv_groups import KVGroups
from engine.models import loader
from engine.runner import HEADER, NOOP, STOP, ModelRunner, StepTensors
from kernels.backend import AttentionBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its part of the model, decided once by the driver."""

    files: loader.ModelFiles | None  # None for random (dummy) weights
    hf_config: object
    dtype: torch.dtype
    device: str
    max_positions: int
    num_blocks: int
    block_size: int
    attention_backend: AttentionBackend  # loaded by the driver; the workers' builds hit its cache
    seed: int
    tp: int
    pp: int
    port: int
    timeout_s: float
    kv_groups: KVGroups | None = None  # None: a cache tensor per layer of this rank's stage


def build(spec: WorkerSpec, rank: int, waiting: Callable[[], None] | None = None
          ) -> tuple[parallel.Dist, ModelRunner]:
    """Join the groups, then load this rank's slices of the checkpoint (every rank, the driver
    too; the driver passes `waiting`, which raises once a worker has died)."""
    layout = parallel.Layout(spec.tp, spec.pp, rank)
    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    cores = layout.cores(parallel.visible_cores())
    if cores is not None and device.type == "cpu":
        torch.set_num_threads(len(cores))
    group = parallel.connect(layout, spec.port, parallel.backend_for(device), spec.timeout_s, waiting)
    model = loader.build_model(spec.files, spec.hf_config, spec.dtype, device, max_positions=spec.max_positions,
                               dummy=spec.files is None, seed=spec.seed + rank,
                               fused=spec.attention_backend.fused_kernels(), dist=group)
    runner = ModelRunner(model, spec.num_blocks, spec.block_size, spec.dtype, device, spec.attention_backend,
                         cores, spec.kv_groups)
    return group, runner


def main(rank: int, spec: WorkerSpec) -> None:
    """The worker's life: build, say ready, then run every step the driver sends until STOP."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        group, runner = build(spec, rank)
        layout = group.layout
        control, world = group.control, group.world
        control.send(torch.ones(1), 0).wait()  # ready
        feeder = 0 if layout.first else layout.rank_of(layout.stage - 1, layout.tp_rank)
        nxt = None if layout.last else layout.rank_of(layout.stage + 1, layout.tp_rank)
        pending: list = []  # sends to the next stage still in progress, with their tensors
        while True:
            header = torch.empty(HEADER, dtype=torch.int64)
            control.recv(header, feeder)
            for work, _ in pending:
                work.wait()
            pending = []
            kind = int(header[0])
            if kind in (NOOP, STOP):
                if nxt is not None:
                    control.send(header, nxt).wait()
                if kind == STOP:
                    return
                continue
            body = torch.empty(StepTensors.body_size(header), dtype=torch.int64)
            control.recv(body, feeder)
            step = StepTensors.unpack(header, body)
            hidden = None
            if not layout.first:
                hidden = runner.hidden_buffer(step)
                world.recv(hidden, feeder)
            out = runner.forward(step, hidden)
            if nxt is not None:
                pending = [(control.send(header, nxt), header), (control.send(body, nxt), body),
                           (world.send(out, nxt), out)]
            elif layout.tp_rank == 0 and out.shape[0]:  # the last stage's logits go back to the driver
                world.send(out, 0).wait()
    except BaseException:  # noqa: BLE001 - leave loudly: the driver's watchdog reports the exit
        logger.exception("worker rank %d failed", rank)
        os._exit(1)
