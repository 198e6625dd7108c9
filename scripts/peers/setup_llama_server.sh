#!/usr/bin/env bash
# llama.cpp's llama-server as a benchmark peer, built from the llama.cpp sources that the
# llama-cpp-python sdist vendors, under the ignored .peers/ folder. Never a dependency:
# only scripts/bench_latency.py --peer llama uses it, on the same GGUF file as ours.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.peers/llama.cpp
BIN="$DIR/build/bin/llama-server"
if [ ! -x "$BIN" ]; then
  mkdir -p "$DIR"
  .venv/bin/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$DIR"
  tar -xzf "$DIR"/llama_cpp_python-0.3.36.tar.gz -C "$DIR"
  SRC="$DIR/llama_cpp_python-0.3.36/vendor/llama.cpp"
  # Native CPU build (the same -march=native our kernels get), no network client.
  # Compiler warnings go to a log; its tail is shown if the build fails.
  { cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON &&
    cmake --build "$DIR/build" --target llama-server -j "$(nproc)"; } >"$DIR/build.log" 2>&1 ||
    { tail -40 "$DIR/build.log"; exit 1; }
fi
"$BIN" --version 2>&1 | head -2
