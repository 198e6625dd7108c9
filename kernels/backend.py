"""The attention backend one engine runs: chosen once when its config resolves
(`select`), loaded once where the engine builds its model (`load`), then called by the
runner and the model. Nobody else compares backend names.

Choosing builds nothing. Loading builds the native CPU kernels (once per machine); when
they cannot be built, "auto" falls back to the torch path after one warning and an
explicit "native" is an error naming attention_backend.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import cpu, reference


class AttentionBackend:
    name = "torch"
    pins_threads = False  # the native build pins torch's threads to cores on first use
    # Capturable in a CUDA graph (engine/cuda_graphs.py): every shape read on the device,
    # no host sync; the reference's store_kv asks the host whether any slot is padding.
    graph_safe = False

    def load(self) -> AttentionBackend:
        """The backend that will run, ready: this one, or a fallback."""
        return self

    def fused_kernels(self) -> Any:
        """The module whose add_rms_norm, rope_qk and silu_mul the decoder's fused layer calls
        (DecoderLayer.forward_fused), where this backend has them; None: the module path."""
        return None

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the step's new tokens (decodes first, then prefill chunks;
        `meta` is engine.models.layers.attention.AttnMetadata) over the paged cache. With a
        `window` > 0, query p sees keys (p - window, p]; `softcap` > 0 caps each scaled
        score s at softcap * tanh(s / softcap); `sinks` (fp32 [H]) add one logit per head
        to every softmax, a key with no value (gpt-oss's attention sinks)."""
        nd, n = meta.num_decode_tokens, q.shape[0]
        if nd == n:
            return self.decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                               window, softcap, sinks)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                                   window, softcap, sinks)
        out[nd:] = self.prefill(q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                meta.prefill_seq_lens, scale, window, softcap, sinks)
        return out

    def decode(self, *args) -> torch.Tensor:
        return reference.paged_attention_decode(*args)

    def prefill(self, *args) -> torch.Tensor:
        return reference.paged_attention_prefill(*args)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"

    def conv(self, state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor,
             x: torch.Tensor, weight: torch.Tensor, silu: bool = True) -> torch.Tensor:
        """A state-keeping layer's convolution over every sequence's new inputs (reference.conv)."""
        return reference.conv(state, slots, fresh, starts, x, weight, silu)

    def gated_delta_rule(self, state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor,
                         x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, A_log: torch.Tensor,
                         dt_bias: torch.Tensor, norm_weight: torch.Tensor, key_heads: int, eps: float) -> torch.Tensor:
        """A linear-attention layer after its convolution, over every sequence's new tokens
        on their state slots (reference.gated_delta_rule)."""
        return reference.gated_delta_rule(state, slots, fresh, starts, x, a, b, z, A_log, dt_bias, norm_weight,
                                          key_heads, eps)


class TorchBackend(AttentionBackend):
    """The pure-torch reference path: every device, no build."""


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def fused_kernels(self) -> Any:
        from kernels import triton_fused

        return triton_fused

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        from kernels import triton_attention  # Triton is imported only when it runs

        triton_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, *args) -> torch.Tensor:
        from kernels import triton_attention

        return triton_attention.paged_attention_decode(*args)

    def prefill(self, *args) -> torch.Tensor:
        from kernels import triton_attention

        return triton_attention.paged_attention_prefill(*args)


class NativeBackend(AttentionBackend):
    """The C++ CPU kernels (kernels/cpu.py): decode and prefill chunks in one call per layer."""

    name = "native"
    pins_threads = True

    def __init__(self, required: bool = False) -> None:
        self.required = required  # asked for by name: no fallback

    def load(self) -> AttentionBackend:
        from engine.errors import ParamError

        if cpu.load():
            return self
        if self.required:
            raise ParamError("attention_backend", "the native CPU kernel could not be built (see the warning)")
        return TorchBackend()

    def fused_kernels(self) -> Any:
        return cpu

    def conv(self, state, slots, fresh, starts, x, weight, silu: bool = True) -> torch.Tensor:
        return cpu.conv(state, slots, fresh, starts, x, weight, silu)

    def gated_delta_rule(self, state, slots, fresh, starts, x, a, b, z, A_log, dt_bias, norm_weight, key_heads,
                         eps) -> torch.Tensor:
        return cpu.gated_delta_rule(state, slots, fresh, starts, x, a, b, z, A_log, dt_bias, norm_weight, key_heads,
                                    eps)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        cpu.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale: float, window: int = 0, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        return cpu.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                   scale, window, softcap, sinks)


def select(name: str, device: torch.device) -> AttentionBackend:
    """The backend a config asks for on this device: "auto" is Triton on CUDA and the
    native kernels on the CPU. Checks what can be checked without building anything."""
    from engine.errors import ParamError

    if name == "triton":
        import os

        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ParamError("attention_backend", "attention_backend triton on the CPU needs TRITON_INTERPRET=1; "
                             "use auto, native or torch")
        return TritonBackend()
    if name == "native":
        if device.type != "cpu":
            raise ParamError("attention_backend", "attention_backend native is the CPU kernel; use triton on cuda")
        return NativeBackend(required=True)
    if name == "torch":
        return TorchBackend()
    return TritonBackend() if device.type == "cuda" else NativeBackend()
