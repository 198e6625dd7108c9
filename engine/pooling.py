"""Embeddings from a decoder's last hidden states (after its final norm), pooled over the
prompt: the last token's (decoder embedding models such as Qwen3-Embedding) or the mean
of all of them. An embedding request is a prefill that samples nothing: it runs in the
same steps as generation and gives its KV blocks back in the step its prompt completes.

How an engine pools comes from its config (`pooler:`) or, when that is unset, from a
sentence-transformers checkpoint's own files (modules.json, then the Pooling module's
config.json), as vLLM reads them. A model with neither serves no embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
from pydantic import BaseModel, ConfigDict

from engine.errors import ParamError

if TYPE_CHECKING:
    import torch

PoolingType = Literal["last", "mean"]
MAX_DIMS = 1 << 20  # past any hidden size; an integer this bounded always crosses to the engine process


class PoolerConfig(BaseModel):
    """An engine's pooling. `matryoshka` says which `dimensions` a request may cut the
    vector to: none (False), any up to the hidden size (True), or the listed ones (the
    sizes a Matryoshka-trained model was trained at)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: PoolingType
    normalize: bool = True
    matryoshka: bool | list[int] = False


class PoolingParams(msgspec.Struct, kw_only=True, array_like=True):
    """One pooling request's options: an embedding (None leaves the engine's pooler to
    decide) or, with task "score", the scoring head's scores at the last token (engine/scoring.py)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def validate(self) -> PoolingParams:
        if self.task not in ("embed", "score"):
            raise ParamError("task", f"task must be \"embed\" or \"score\", got {self.task!r}")
        if self.dimensions is not None and (type(self.dimensions) is not int or not 1 <= self.dimensions <= MAX_DIMS):
            raise ParamError("dimensions", f"dimensions must be an integer from 1 to {MAX_DIMS}, got "
                             f"{self.dimensions!r}")
        if self.normalize is not None and type(self.normalize) is not bool:
            raise ParamError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        return self


def check(params: PoolingParams, pooler: PoolerConfig, hidden_size: int) -> None:
    """What only the engine knows: whether this model may cut its vectors to `dimensions`."""
    d = params.dimensions
    if d is None or d == hidden_size:
        return
    if pooler.matryoshka is False:
        raise ParamError("dimensions", f"this model's embeddings cannot be shortened: it gives {hidden_size} "
                         "dimensions and was not trained for fewer (no matryoshka dimensions)")
    if d > hidden_size:
        raise ParamError("dimensions", f"dimensions ({d}) exceeds the model's {hidden_size}")
    if isinstance(pooler.matryoshka, list) and d not in pooler.matryoshka:
        raise ParamError("dimensions", f"dimensions ({d}) is not one this model was trained for: "
                         f"{sorted(pooler.matryoshka)}")


def finish(vector: torch.Tensor, params: PoolingParams, pooler: PoolerConfig) -> list[float]:
    """The pooled fp32 vector as the request asked: cut to `dimensions`, then normalized
    (a cut vector is normalized again, as Matryoshka models are used)."""
    import torch

    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()


def from_checkpoint(path: Path, hf_config: object) -> PoolerConfig | None:
    """A sentence-transformers checkpoint's pooling, when it has a Pooling module of a kind
    served here; its Normalize module decides `normalize`. None for any other checkpoint."""
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling_dir = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        settings = json.loads((path / pooling_dir / "config.json").read_text())
    except (StopIteration, OSError, ValueError, KeyError, TypeError) as exc:
        raise ParamError("pooler", f"{modules_file}: no readable Pooling module ({exc}); "
                         "set engine.pooler in the preset instead") from None
    if settings.get("pooling_mode_lasttoken"):
        kind: PoolingType = "last"
    elif settings.get("pooling_mode_mean_tokens"):
        kind = "mean"
    else:
        modes = sorted(k for k, v in settings.items() if k.startswith("pooling_mode") and v)
        raise ParamError("pooler", f"{path}: its pooling ({', '.join(modes) or 'none'}) is not served here "
                         "(last token or mean); set engine.pooler in the preset")
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka: bool | list[int] = [int(d) for d in dims] if dims else bool(getattr(hf_config, "is_matryoshka", False))
    return PoolerConfig(pooling_type=kind, normalize=normalize, matryoshka=matryoshka)

