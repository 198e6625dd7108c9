#!/usr/bin/env bash
# Everything a lent GPU should answer, in one command: about 6 minutes, each step under a limit of its
# own and 10 minutes in all (docs/gpu.md):
#   1. the gpu test tier (tests/gpu/test_gpu.py): greedy fp32 equal to transformers, bf16 within
#      tolerance, CUDA-graph replay equal to eager, prefix caching, preemption, speculation;
#   2. the Triton kernels' tests on the device (tests/unit/test_kernels.py, test_window_attention.py
#      and test_fused_ops.py, KERNELS_NATIVE=1), every compiled configuration included;
#   3. scripts/bench_kernels.py: decode attention against the copy bandwidth;
#   4. scripts/bench_gpu.py: two runs each of throughput at a 1.7B shape (graphs, eager, transformers) and the
#      batch-1 decode step against the weights' bytes over the bandwidth;
#   5. scripts/profile_gpu.py at batch 1 with graphs: where that step's time goes, host and device.
# It runs with the machine's own PyTorch and Triton (no network there); the project's other
# needs travel as wheels in an ignored .whl/ folder (docs/gpu.md says which). Logs and
# results go under $OUT (./gpu_out when unset). Without a CUDA device it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET

echo "== gpu_check $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device: nothing to check here ($("$PY" -c 'import torch; print("torch", torch.__version__)' \
        2>/dev/null || echo "$PY has no torch; PYTHON names another interpreter"))"
    exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'EOF'
import platform, torch, triton, transformers
p = torch.cuda.get_device_properties(0)
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
print(f"device {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || true

failed=()
step() {  # step NAME SECONDS CMD...: run it under a time limit, note a failure, go on
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

step "gpu tier" 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py --junitxml "$OUT/gpu_tier.xml"
# test_window_attention's Triton cases (windows, soft-caps, sinks); its CPU-kernel cases are the CI's.
# test_fused_ops: the fused layer's add + RMSNorm, q/k norm + rotary and SiLU-mul.
step "kernels on the device" 150 env KERNELS_NATIVE=1 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py \
    tests/unit/test_window_attention.py tests/unit/test_fused_ops.py -k "not reference_and_native" -x \
    --junitxml "$OUT/kernels.xml"
step "bench_kernels" 60 "$PY" scripts/bench_kernels.py --batches 1,32,256 --contexts 512,4096 --out "$OUT/bench_kernels.md"
step "bench_gpu" 180 "$PY" scripts/bench_gpu.py --pairs 2 --out "$OUT/bench_gpu.md"
step "profile_gpu" 90 "$PY" scripts/profile_gpu.py --requests 1 --output-len 128 --modes graphs --out "$OUT"

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "== gpu_check: all passed"
else
    echo "== gpu_check: failed: ${failed[*]}"
    exit 1
fi
