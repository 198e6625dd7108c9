"""Fill a (possibly sharded) DecoderForCausalLM from transformers-named checkpoint tensors.

Each tensor arrives as something sliceable, a safetensors slice or a tensor, and only the
rows or columns this rank holds are read: under tensor parallelism a rank never
materializes the whole checkpoint. Separate q/k/v and gate/up tensors go into their
fused parameters; checkpoints that already fuse them (Phi-3's qkv_proj and gate_up_proj)
are split the same way. Experts come one tensor per expert (Mixtral, Qwen) or stacked per
layer (transformers 5, gpt-oss, GGUF conversions), and gpt-oss's also in MXFP4 pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from engine.models.layers.moe import SparseMoE

if TYPE_CHECKING:
    from engine.models.decoder import DecoderForCausalLM

PREFUSED = ("qkv_proj", "gate_up_proj")
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         # Qwen3.5's linear-attention input projections, one GEMM (GatedDeltaNet.in_proj)
         "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
         "in_proj_a": ("in_proj", 3)}


def load(model: DecoderForCausalLM, weights: Iterable[tuple[str, object]],
         absent: Callable[[str], bool] | None = None) -> None:
    """`absent`: the parameters the checkpoint may leave unfilled, because something else
    fills them after (quantize.apply from a GGUF's blocks)."""
    params = dict(model.named_parameters())
    first_layer, end_layer = model.layer_range
    loaded: set[str] = set()
    pairs: dict[str, dict[str, object]] = {}  # MXFP4 blocks waiting for their scales, or scales for blocks
    for name, src in weights:
        if "rotary_emb" in name:
            continue
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] == "layers":
            index = int(parts[1])
            if not first_layer <= index < end_layer:
                continue  # another pipeline stage's layer
            parts[1] = str(index - first_layer)
            name = ".".join(parts)
        if name == "lm_head.weight" and model.tie:
            continue
        if parts[0] in ("embed_tokens", "lm_head", "norm") and not _holds(model, parts[0]):
            continue  # held by another pipeline stage
        if name == "lm_head.bias" and "lm_head_bias" in params:  # beside the head, sliced as its rows
            name, parts, src = "lm_head_bias", ["lm_head_bias"], _vocab_rows(model, src, model.vocab_shard)
        module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
        if len(parts) >= 5 and parts[-4] == "experts":
            loaded.add(_load_expert(model, params, parts, src))
            continue
        if len(parts) >= 4 and parts[-2] == "experts":
            loaded.update(_load_stacked(model, parts, src, pairs))
            continue
        owner = _module(model, ".".join(parts[:-2]), name)
        if module in PREFUSED:
            name = ".".join(parts)
            param = params[name]
            for shard, (base, piece) in enumerate(_prefused_pieces(model, module, owner)):
                start, size = _fused_range(owner, module, shard)
                lo, hi = _rows_range(model, owner, piece)
                _copy(param[start:start + size], _rotary_order(model, piece, src[base + lo:base + hi]), name)
                loaded.add(f"{name}#{shard}")
            continue
        if module in FUSED:
            target, shard = FUSED[module]
            if target == "gate_up_proj":  # up alone where the MLP is not gated
                shard = _pieces(owner, name).index(module)
            name = ".".join(parts[:-2] + [target, leaf])
            param = params[name]
            start, size = _fused_range(owner, target, shard)
            lo, hi = _rows_range(model, owner, module)
            _copy(param[start:start + size], _rotary_order(model, module, src[lo:hi]), name)
            loaded.add(f"{name}#{shard}")
            continue
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        param = params[name]
        if module in ("o_proj", "down_proj"):
            tensor = _cols(model, owner, module, src) if leaf == "weight" else _bias(model, src)
        elif module in ("embed_tokens", "lm_head"):
            tensor = _vocab_rows(model, src, param.shape[0])
        elif leaf == "choice_bias":  # ERNIE keeps it as [1, experts]
            tensor = src[...].reshape(-1)
        elif leaf == "sinks":  # one per query head: this rank's heads
            heads = model.attention.heads
            tensor = src[heads.q_lo:heads.q_hi]
        else:
            tensor = src[...]  # every dim (a 0-d one too: xIELU's beta and eps)
        _copy(param, tensor, name)
        loaded.add(name)
    if pairs:
        name, got = next(iter(pairs.items()))
        raise ValueError(f"{name}_{'scales' if 'blocks' in got else 'blocks'} is missing: MXFP4 tensors come in pairs")
    _check_complete(model, {n: p for n, p in params.items() if absent is None or not absent(n)}, loaded)


def _holds(model: DecoderForCausalLM, top: str) -> bool:
    """Whether this pipeline stage holds the embedding (the first; the last too when the
    head is tied to it) or the final norm and head (the last). A tensor the stage holds
    but has no parameter for is then the checkpoint's error, not another stage's."""
    return hasattr(model, "embed_tokens") if top == "embed_tokens" else model.last


def _module(model: DecoderForCausalLM, path: str, name: str):
    """The module at `path` (the model itself for ""), whose sizes a tensor's slices
    follow; a path the model does not have is the checkpoint's error, naming the tensor."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"unexpected weight {name!r} in checkpoint") from None


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def _head_rows(model: DecoderForCausalLM, module: str) -> tuple[int, int]:
    heads = model.attention.heads
    d = model.attention.head_dim
    if module == "q_proj":  # each head's query rows, and its gate's after them where it has one
        rows = d * (2 if model.attention.gated else 1)
        return heads.q_lo * rows, heads.q_hi * rows
    return heads.kv_lo * d, heads.kv_hi * d


def _rows_range(model: DecoderForCausalLM, owner, module: str) -> tuple[int, int | None]:
    """Column-parallel: this rank's output rows of a projection (and its bias entries);
    an MLP's by its own intermediate size (a MoE model's dense and shared-expert MLPs differ)."""
    if module.startswith("in_proj_"):  # a linear-attention layer's: whole (it is never split)
        return 0, None
    return _head_rows(model, module) if module in ("q_proj", "k_proj", "v_proj") else owner.inter_range


def _rotary_order(model: DecoderForCausalLM, piece: str, rows: torch.Tensor) -> torch.Tensor:
    """q or k rows (weight or bias, whole heads) of an architecture whose rotary pairs
    adjacent dims (GLM, ERNIE 4.5), each head's rotary dims reordered to rotate-half's
    pairs (i, i + rot / 2). q and k move alike, so the scores are the same sums, and the
    rotation the same products; every path (fused, Triton, reference) then turns them
    as it turns Llama's."""
    if piece not in ("q_proj", "k_proj") or not model.arch.rope_interleaved:
        return rows
    return rows[rotary_order(model, rows.shape[0] // model.attention.head_dim)]


def rotary_order(model: DecoderForCausalLM, heads: int) -> torch.Tensor:
    """The row index of `_rotary_order` over `heads` whole heads (also a GGUF file's q and
    k rows, engine/models/gguf_blocks.py)."""
    d, rot = model.attention.head_dim, model.rotary_dims
    order = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d)])
    return (torch.arange(heads)[:, None] * d + order).reshape(-1)


def _prefused_pieces(model: DecoderForCausalLM, module: str, owner) -> list[tuple[int, str]]:
    """Where each piece of an already-fused checkpoint tensor starts, and what it is (an
    MLP's by its own intermediate size: a shared expert's is not the dense MLP's)."""
    config = model.config
    if module == "qkv_proj":
        d = model.attention.head_dim
        q, kv = config.num_attention_heads * d, (config.num_key_value_heads or config.num_attention_heads) * d
        return [(0, "q_proj"), (q, "k_proj"), (q + kv, "v_proj")]
    return [(0, "gate_proj"), (owner.intermediate, "up_proj")]


def _cols(model: DecoderForCausalLM, owner, module: str, src) -> torch.Tensor:
    """Row-parallel: this rank's input columns."""
    lo, hi = _head_rows(model, "q_proj") if module == "o_proj" else owner.inter_range
    return src[:, lo:hi]


def _load_expert(model: DecoderForCausalLM, params: dict[str, torch.Tensor], parts: list[str], src) -> str:
    """One expert's gate, up or down projection into the expert layer's stacked parameters
    (this rank's slice of its intermediate size); the key it counts as loaded."""
    moe = _module(model, ".".join(parts[:-4]), ".".join(parts))
    expert, module, prefix = parts[-3], parts[-2], ".".join(parts[:-4])
    if (not isinstance(moe, SparseMoE) or module not in ("gate_proj", "up_proj", "down_proj")
            or parts[-1] != "weight" or not expert.isdigit() or int(expert) >= moe.spec.experts):
        raise ValueError(f"unexpected weight {'.'.join(parts)!r} in checkpoint")
    expert, (lo, hi) = int(expert), moe.inter_range
    if module == "down_proj":
        _copy(moe.experts_down[expert], src[:, lo:hi], f"{prefix}.experts_down")
        return f"{prefix}.experts_down#{expert}"
    shard = 0 if module == "gate_proj" else 1
    _copy(moe.experts_gate_up[expert, shard * moe.inter:(shard + 1) * moe.inter], src[lo:hi],
          f"{prefix}.experts_gate_up")
    return f"{prefix}.experts_gate_up#{expert}.{shard}"


STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _load_stacked(model: DecoderForCausalLM, parts: list[str], src, pairs: dict[str, dict[str, object]]
                  ) -> list[str]:
    """A layer's experts stacked in one tensor: `gate_up_proj` and `down_proj` as Linear
    weights [E, out, in], gate rows first; or gpt-oss's (model.interleaved_experts),
    [E, in, out] with gate and up interleaved, their biases, or the MXFP4 pairs
    `<name>_blocks` / `<name>_scales` holding them as [E, out, in], still interleaved.
    Read one expert at a time, this rank's slice of I; the keys it counts as loaded."""
    from engine.models import mxfp4

    name, prefix, leaf = ".".join(parts), ".".join(parts[:-2]), parts[-1]
    moe = _module(model, prefix, name)
    base = leaf.removesuffix("_blocks").removesuffix("_scales")
    if not isinstance(moe, SparseMoE) or (leaf not in STACKED and base not in STACKED[::2]):
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    if base != leaf:  # an MXFP4 half: wait for its other half
        got = pairs.setdefault(f"{prefix}.experts.{base}", {})
        got[leaf[len(base) + 1:]] = src
        if len(got) < 2:
            return []
        del pairs[f"{prefix}.experts.{base}"]
        src, scales = got["blocks"], got["scales"]
        if model.keep_mxfp4:
            return _keep_mxfp4(model, moe, f"{prefix}.experts.{base}", src, scales)
        expert = lambda e: mxfp4.dequantize(_row(src, e), _row(scales, e), f"{prefix}.experts.{base}")  # noqa: E731
    elif model.interleaved_experts and leaf in STACKED[::2]:  # gpt-oss's x @ W: a Linear's weight transposed
        expert = lambda e: _row(src, e).t()  # noqa: E731
    else:
        expert = lambda e: _row(src, e)  # noqa: E731
    _check_experts(moe, src, name)
    lo, hi = moe.inter_range
    keys = []
    for e in range(moe.spec.experts):
        w = expert(e)
        if base.startswith("gate_up_proj"):
            if model.interleaved_experts:  # gate at the even rows, up at the odd
                gate, up = w[0::2], w[1::2]
            else:
                gate, up = w.chunk(2)
            dest = moe.experts_gate_up_bias if leaf.endswith("bias") else moe.experts_gate_up
            _copy(dest[e], torch.cat((gate[lo:hi], up[lo:hi])), name)
            keys += [f"{prefix}.experts_gate_up_bias"] if leaf.endswith("bias") else \
                [f"{prefix}.experts_gate_up#{e}.0", f"{prefix}.experts_gate_up#{e}.1"]
        elif leaf.endswith("bias"):  # row-parallel: added once, after the ranks' sum
            _copy(moe.experts_down_bias[e], _bias(model, w), name)
            keys.append(f"{prefix}.experts_down_bias")
        else:
            _copy(moe.experts_down[e], w[:, lo:hi], name)
            keys.append(f"{prefix}.experts_down#{e}")
    return keys


def _keep_mxfp4(model: DecoderForCausalLM, moe: SparseMoE, name: str, blocks, scales) -> list[str]:
    """`quantization: mxfp4`: each expert's MXFP4 rows kept as GGML blocks in moe.kept_mxfp4
    (gate rows before up rows, as the dense layout), for engine/models/quantize.py to
    compute on; the dense expert tensors are never written. The keys the dense path counts."""
    from engine.models import mxfp4

    _check_experts(moe, blocks, name)
    hidden = moe.gate.in_features
    gate_up = name.endswith("gate_up_proj")
    rows, cols = (2 * moe.inter, hidden) if gate_up else (hidden, moe.inter)
    kept, keys = [], []
    prefix = name.rsplit(".experts.", 1)[0]
    for e in range(moe.spec.experts):
        b, s = _row(blocks, e), _row(scales, e)
        if tuple(b.shape) != (rows, cols // mxfp4.BLOCK, mxfp4.BLOCK // 2):
            raise ValueError(f"weight {name}_blocks has expert shape {tuple(b.shape)}, expected "
                             f"{(rows, cols // mxfp4.BLOCK, mxfp4.BLOCK // 2)}")
        if gate_up and model.interleaved_experts:  # gate at the even rows, up at the odd
            b, s = torch.cat((b[0::2], b[1::2])), torch.cat((s[0::2], s[1::2]))
        kept.append(mxfp4.to_gguf_blocks(b, s, name))
        keys += [f"{prefix}.experts_gate_up#{e}.0", f"{prefix}.experts_gate_up#{e}.1"] if gate_up else \
            [f"{prefix}.experts_down#{e}"]
    moe.kept_mxfp4["gate_up" if gate_up else "down"] = kept
    return keys


def _row(src, e: int) -> torch.Tensor:
    """Expert e of a stacked tensor or safetensors slice."""
    return src[e:e + 1][0]


def _check_experts(moe: SparseMoE, src, name: str) -> None:
    shape = tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())
    if not shape or shape[0] != moe.spec.experts:
        raise ValueError(f"weight {name!r} has shape {shape}: its first dimension must be the "
                         f"{moe.spec.experts} experts")


def _bias(model: DecoderForCausalLM, src) -> torch.Tensor:
    """A row-parallel bias is added once, after the all-reduce sums the ranks: rank 0 holds it."""
    full = src[:]
    return full if model.dist.tp.rank == 0 else torch.zeros_like(full)


def _vocab_rows(model: DecoderForCausalLM, src, shard: int) -> torch.Tensor:
    rows = src[model.vocab_lo:model.vocab_hi]
    if rows.shape[0] < shard:  # the last shard's padding
        rows = torch.cat((rows, rows.new_zeros(shard - rows.shape[0], *rows.shape[1:])))
    return rows


def _fused_range(owner, target: str, shard: int) -> tuple[int, int]:
    if target == "qkv_proj":
        sizes = [owner.q_rows, owner.kv_size, owner.kv_size]
    elif target == "in_proj":
        sizes = list(owner.in_sizes)
    else:
        sizes = [owner.inter] * len(owner.pieces)
    return sum(sizes[:shard]), sizes[shard]


def _pieces(owner, name: str) -> tuple[str, ...]:
    """The checkpoint tensors an MLP's first GEMM holds; a gate for a plain MLP is the
    checkpoint's error, naming the tensor."""
    if name.split(".")[-2] not in owner.pieces:
        raise ValueError(f"unexpected weight {name!r} in checkpoint: this architecture's MLP has no gate")
    return owner.pieces


def _check_complete(model: DecoderForCausalLM, params: dict[str, torch.Tensor], loaded: set[str]) -> None:
    """Every parameter loaded; a headless model's (sequence classification) LM head excepted."""
    expected = set()
    for name in params:
        leaf = name.split(".")[-2] if "." in name else name
        if leaf == "qkv_proj":
            expected |= {f"{name}#{i}" for i in range(3)}
        elif leaf == "in_proj" and ".linear_attn." in name:
            expected |= {f"{name}#{i}" for i in range(4)}
        elif leaf == "gate_up_proj":
            expected |= {f"{name}#{i}" for i in range(len(model.get_submodule(name.rsplit(".", 2)[0]).pieces))}
        elif name.endswith(".experts_gate_up"):
            expected |= {f"{name}#{e}.{i}" for e in range(params[name].shape[0]) for i in range(2)}
        elif name.endswith(".experts_down"):
            expected |= {f"{name}#{e}" for e in range(params[name].shape[0])}
        else:
            expected.add(name)
    if model.headless:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
