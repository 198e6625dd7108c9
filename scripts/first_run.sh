#!/usr/bin/env bash
# A fresh clone's first run on this machine, as a new user gets it: clone, make's set-up
# steps (as `make -n setup` prints them) with empty model, kernel and BentoML caches, then
# `make serve` and a chat request every 0.5 s until one is answered. Prints the pip
# installs' time and the first answer's time after them (benchmarks/LOG.md, "The layout
# and the first run"). pip's own download cache is left as it is.
#
#   bash scripts/first_run.sh [SOURCE_REPO] [WORK_DIR]     # default: this checkout, /tmp/first_run
set -u
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
D=${2:-/tmp/first_run}
PORT=${PORT:-3917}
rm -rf "$D" "$D.state"
git clone -q "$SRC" "$D" && mkdir -p "$D.state" && cd "$D" || exit 1
export PAGEDSERVE_CACHE=$D.state/cache TORCH_EXTENSIONS_DIR=$D.state/ext BENTOML_HOME=$D.state/bento
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }

start=$(now)
make -n setup | grep -v "^\s*#" | grep -v "^touch" > "$D.state/setup.sh"
bash -e "$D.state/setup.sh" > "$D.state/setup.log" 2>&1 || { echo "set-up failed"; tail "$D.state/setup.log"; exit 1; }
echo "pip installs: $(since "$start") s"
installed=$(now)
touch .venv/.installed
make serve PORT="$PORT" > "$D.state/serve.log" 2>&1 &
until curl -s -m 120 -o "$D.state/answer.json" -w "%{http_code}" "http://127.0.0.1:$PORT/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}' \
    2>/dev/null | grep -q 200; do
  sleep 0.5
done
echo "first answer: $(since "$installed") s after the pip installs"
head -c 300 "$D.state/answer.json"; echo
pkill -f -- "--port $PORT"; sleep 3; pkill -9 -f "$D/.venv/bin"; true
