"""vLLM's CPU GEMM (`onednn_mm` on a handle made once per weight) against the prepacked
oneDNN GEMM our engine uses (`torch.ops.mkldnn._linear_pointwise`), on SmolLM2-135M's
shapes, in one process, best of `--repeats`.

Runs inside vLLM's own venv (.peers/vllm, scripts/setup_vllm_peer.sh), with every core:

    VLLM_CPU_OMP_THREADS_BIND=0-1 .peers/vllm/bin/python scripts/peers/vllm_gemm.py --dtype bfloat16
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from vllm import _custom_ops as ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for its timer
from timing import best  # noqa: E402

SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, gate_up, down, head (N, K)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="16,64,256,2048")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    print(f"{'M':>5} {'N':>6} {'K':>5} {'vLLM GFLOP/s':>13} {'ours GFLOP/s':>13}")
    for m in map(int, args.rows.split(",")):
        for n, k in SHAPES:
            if n == 49152 and m > 64:
                continue  # the head only runs on the rows that sample
            w, x = torch.randn(n, k).to(dtype), torch.randn(m, k).to(dtype)
            handle = ops.create_onednn_mm(w.t(), 32)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            t_vllm = best(lambda: ops.onednn_mm(handle, x, None), args.repeats, warmup=3)
            t_ours = best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.repeats,
                           warmup=3)
            flop = 2 * m * n * k / 1e9
            print(f"{m:>5} {n:>6} {k:>5} {flop / t_vllm:13.1f} {flop / t_ours:13.1f}")


if __name__ == "__main__":
    main()
