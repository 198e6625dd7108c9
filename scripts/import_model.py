"""Put a model into the BentoML model store as a new version, for service.py and Bentos.

    python scripts/import_model.py                    # the embedded SmolLM2-135M-Instruct
    python scripts/import_model.py path/to/model.gguf --name my-model
    python scripts/import_model.py path/to/hf_dir --name my-model --served-name My-Model
    python scripts/import_model.py --if-missing       # `make serve`: import once, then reuse
    PAGEDSERVE_CONFIG=config/gemma3-270m.yaml python scripts/import_model.py   # a packaged model, by its tag

What is stored is an HF-format directory (config, tokenizer, safetensors). For a GGUF it
is the file itself beside the tensors that stay dense (norms, biases, routers), made here
once with the engine's own loader: the engine reads the GEMM weights from the file's
blocks at load, computing on them or dequantizing them into the model's dtype
(engine/models/gguf_blocks.py), so the store, the Bento and the image carry the file's
bytes, not an fp32 copy four times its size (the embedded model's stored version: 98 MB,
where the fp32 copy beside the file made 611; LOG.md, session 34). Nothing is
downloaded. The tag defaults to the serving preset's `service.model_tag`
($PAGEDSERVE_CONFIG, else config/default.yaml), which is what service.py looks up.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


# Weight formats the engine does not read: copying them would only bloat the store.
SKIP_SUFFIXES = {".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".lock"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", help="HF directory or .gguf file; omitted = the embedded default model")
    p.add_argument("--name", help="model store name (default: the preset's service.model_tag)")
    p.add_argument("--served-name", help="the OpenAI `model` name to serve it under")
    p.add_argument("--config", help="serving preset to take the default name from")
    p.add_argument("--if-missing", action="store_true", help="do nothing if the store already has this name")
    return p.parse_args(argv)


def hf_dir(source: str | None):
    """Resolve the source to a local HF directory with the engine's loader (a GGUF's holds
    only what the file's blocks do not give)."""
    from engine.models import loader

    from engine.models import packaged

    if source is not None and source not in packaged.PACKAGES and not Path(source).expanduser().exists():
        raise SystemExit(f"error: {source} does not exist")
    files = loader.resolve(source, blocks=True)
    loader.load_config(files)  # refuses architectures the engine cannot run, before storing anything
    if not any(files.path.glob("*.safetensors")):
        raise SystemExit(f"error: {files.path} has no *.safetensors weights")
    return files


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import bentoml
    from bentoml.exceptions import NotFound

    from engine.models import DEFAULT_MODEL_NAME
    from engine.serving.preset import load_preset

    name = args.name or load_preset(args.config).service.model_tag
    if args.if_missing:
        try:
            existing = bentoml.models.get(name)
        except NotFound:
            pass
        else:
            print(f"{existing.tag} is already in the model store ({existing.path}); nothing to do")
            return 0

    from engine.models import packaged

    # No source: the packaged model the tag names (a preset's model_tag), else the embedded one.
    source = args.source or (name if name in packaged.PACKAGES else None)
    files = hf_dir(source)
    if source is None:
        served = args.served_name or DEFAULT_MODEL_NAME
    elif source in packaged.PACKAGES:
        served = args.served_name or packaged.PACKAGES[source].name
    else:
        served = args.served_name or Path(args.source).expanduser().resolve().name.removesuffix(".gguf")
    metadata = {"served_model_name": served, "source": files.source,
                "format": "gguf" if files.blocks_only else "hf-safetensors"}
    with bentoml.models.create(name, labels={"engine": "pagedserve"}, metadata=metadata) as model:
        dest = Path(model.path)
        for item in sorted(files.path.iterdir()):
            # Subdirectories (such as original/ checkpoints) are never read by the engine.
            if item.is_file() and not item.name.startswith(".") and item.suffix not in SKIP_SUFFIXES:
                shutil.copy2(item, dest / item.name)
        if files.blocks_only:  # the GEMM weights, read from its blocks at load (loader.resolve)
            shutil.copy2(files.source, dest / Path(files.source).name)
    stored = bentoml.models.get(model.tag)
    print(f"imported {files.source} as {stored.tag} (serves as {served!r}) into {stored.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
