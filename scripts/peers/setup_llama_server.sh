#!/usr/bin/env bash
# llama.cpp's llama-server as a benchmark peer, built from the llama.cpp sources that the
# llama-cpp-python sdist vendors, under the ignored .peers/ folder. Never a dependency:
# only scripts/bench_latency.py --peer llama uses it, on the same GGUF file as ours.
# `setup_llama_server.sh avx2` builds a second one without AVX-512 (build-avx2/), for
# bench_latency.py --isa avx2.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.peers/llama.cpp
SRC="$DIR/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ "${1:-native}" = avx2 ]; then
  BUILD="$DIR/build-avx2"
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF)
elif grep -qw amx_tile /proc/cpuinfo; then
  # On an AMX Xeon (session 42) the -march=native build died with SIGILL as it loaded any
  # model; this one has every AVX-512 extension ggml uses and leaves its AMX code out.
  BUILD="$DIR/build"
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
       -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
       -DGGML_AMX_BF16=OFF)
else
  BUILD="$DIR/build"
  ISA=(-DGGML_NATIVE=ON)  # the same -march=native our kernels get
fi
BIN="$BUILD/bin/llama-server"
if [ ! -x "$BIN" ]; then
  mkdir -p "$DIR"
  if [ ! -d "$SRC" ]; then
    .venv/bin/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$DIR"
    tar -xzf "$DIR"/llama_cpp_python-0.3.36.tar.gz -C "$DIR"
  fi
  # No network client. Compiler warnings go to a log; its tail is shown if the build fails.
  { cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON &&
    cmake --build "$BUILD" --target llama-server -j "$(nproc)"; } >"$BUILD.log" 2>&1 ||
    { tail -40 "$BUILD.log"; exit 1; }
fi
"$BIN" --version 2>&1 | head -2
