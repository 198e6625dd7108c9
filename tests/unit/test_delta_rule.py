"""The kernels of Qwen3.5's linear-attention layers against their definitions: the gated
delta rule (the torch reference, token by token and in chunks over several chunks and a
padded one, from carried states, on a mixed batch of decode and prompt sequences on their
slots), the layer around it (q/k norms, gates, the gated norm), the native kernel against
the reference, and the causal convolution carried across steps (native and reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu, reference


def _definition(state, q, k, v, g, beta):
    """S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q, one token at a time
    ([n, H, d] inputs, [H, dk, dv] state)."""
    state = state.clone()
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        u = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + torch.einsum("hk,hv->hkv", k[t], u)
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


def _inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, heads, dk, generator=gen, dtype=dtype), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(n, heads, dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(n, heads, dv, generator=gen, dtype=dtype)
    g = -torch.rand(n, heads, generator=gen, dtype=dtype) * 2  # decays in (exp(-2), 1]
    beta = torch.rand(n, heads, generator=gen, dtype=dtype)
    state = torch.randn(heads, dk, dv, generator=gen, dtype=dtype)
    return state, q, k, v, g, beta


def test_chunked_equals_the_definition_across_chunks_and_from_a_carried_state():
    state, q, k, v, g, beta = _inputs(19)
    want_out, want_state = _definition(state, q, k, v, g, beta)
    for chunk in (4, 7, 19, 64):  # whole chunks and a padded one; exactly one; one padded
        out, last = reference.chunked(state, q, k, v, g, beta, chunk=chunk)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(last, want_state)
    # two calls, the second from the state the first left: a prompt taken in two steps
    out1, mid = reference.chunked(state, q[:11], k[:11], v[:11], g[:11], beta[:11], chunk=4)
    out2, last = reference.chunked(mid, q[11:], k[11:], v[11:], g[11:], beta[11:], chunk=4)
    torch.testing.assert_close(torch.cat([out1, out2]), want_out)
    torch.testing.assert_close(last, want_state)


def _batch(lengths: list[int], fresh: list[bool], slots: list[int], num_slots: int, heads: int, dk: int, dv: int,
           dtype=torch.float64):
    """Sequences of these lengths, flat as a step has them, their states in `slots`."""
    seqs = [_inputs(n, heads, dk, dv, seed=i, dtype=dtype) for i, n in enumerate(lengths)]
    state = torch.randn(num_slots, heads, dk, dv, dtype=dtype, generator=torch.Generator().manual_seed(9))
    for slot, s in zip(slots, seqs):
        state[slot] = s[0]
    flat = [torch.cat([s[j] for s in seqs]) for j in range(1, 6)]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return seqs, state, torch.tensor(slots), torch.tensor(fresh), starts, flat


def test_the_reference_runs_decode_and_prompt_sequences_on_their_slots():
    """Two decode tokens (one of them fresh), a prompt chunk from a carried state, a fresh
    prompt: each sequence's definition, on its own slot; the slots between untouched."""
    lengths, fresh, slots = [1, 1, 9, 70], [False, True, False, True], [3, 0, 5, 1]
    seqs, state, slot_t, fresh_t, starts, (q, k, v, g, beta) = _batch(lengths, fresh, slots, 7, 3, 8, 5)
    untouched = state[[2, 4, 6]].clone()
    out = reference.delta_rule(state, slot_t, fresh_t, starts, q, k, v, g, beta)
    for i, (s0, *rest) in enumerate(seqs):
        want_out, want_state = _definition(torch.zeros_like(s0) if fresh[i] else s0, *rest)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want_out)
        torch.testing.assert_close(state[slots[i]], want_state)
    torch.testing.assert_close(state[[2, 4, 6]], untouched)


def _layer_inputs(lengths: list[int], key_heads: int, heads: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 5):
    """What a layer hands gated_delta_rule: convolved q, k, v rows, a, b, z, its weights."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x, a, b, z = r(n, 2 * key_heads * dk + heads * dv), r(n, heads), r(n, heads), r(n, heads * dv)
    A_log, dt_bias, weight = r(heads, scale=0.5), r(heads, scale=0.5), 1 + r(dv, scale=0.3)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return starts, x, a, b, z, A_log, dt_bias, weight


def test_the_layers_reference_norms_gates_and_shares_key_heads_as_the_definition_says():
    """reference.gated_delta_rule against the layer written out: q and k L2-normed
    (q over the key dim's root), key head j serving value heads 2j and 2j + 1, beta =
    sigmoid(b), the decay exp(-exp(A_log) softplus(a + dt_bias)), the delta rule from each
    sequence's state, and the gated RMSNorm of each head's output."""
    lengths, key_heads, heads, dk, dv = [1, 6], 2, 4, 8, 5
    starts, x, a, b, z, A_log, dt_bias, weight = _layer_inputs(lengths, key_heads, heads, dk, dv, torch.float32)
    state = torch.randn(3, heads, dk, dv, generator=torch.Generator().manual_seed(6))
    slots, fresh = torch.tensor([2, 0]), torch.tensor([False, True])
    before = state.clone()
    got = reference.gated_delta_rule(state, slots, fresh, starts, x, a, b, z, A_log, dt_bias, weight, key_heads, 1e-6)
    q, k, v = x.split([key_heads * dk, key_heads * dk, heads * dv], dim=-1)
    q = F.normalize(q.reshape(-1, key_heads, dk), dim=-1, eps=0)[:, [0, 0, 1, 1]] * dk ** -0.5
    k = F.normalize(k.reshape(-1, key_heads, dk), dim=-1, eps=0)[:, [0, 0, 1, 1]]
    g = -A_log.exp() * F.softplus(a + dt_bias)
    for i, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        s0 = torch.zeros_like(before[0]) if fresh[i] else before[slots[i]]
        o, last = _definition(s0, q[lo:hi], k[lo:hi], v[lo:hi].reshape(-1, heads, dv), g[lo:hi], b[lo:hi].sigmoid())
        want = weight * o / o.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * F.silu(z[lo:hi].reshape(-1, heads, dv))
        torch.testing.assert_close(got[lo:hi], want.reshape(hi - lo, -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[slots[i]], last, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_heads,heads,dk,dv", [(4, 4, 128, 128), (2, 6, 20, 37)])  # Qwen3.5's; shared keys, tails
def test_the_native_layer_kernel_equals_the_reference_on_a_mixed_batch(dtype, key_heads, heads, dk, dv):
    """kernels/csrc/linear_attention.cpp's gated_delta_rule: decode tokens (one fresh), a
    prompt chunk from a carried state and a fresh prompt, on their slots; in bf16 each
    rounding where transformers rounds."""
    lengths = [1, 1, 1, 40, 3]
    slots, fresh = torch.tensor([4, 0, 2, 5, 6]), torch.tensor([False, True, False, False, True])
    starts, x, a, b, z, A_log, dt_bias, weight = _layer_inputs(lengths, key_heads, heads, dk, dv, dtype)
    state = torch.randn(7, heads, dk, dv, generator=torch.Generator().manual_seed(8))
    want_state = state.clone()
    args = (slots, fresh, starts, x, a, b, z, A_log, dt_bias, weight, key_heads, 1e-6)
    want = reference.gated_delta_rule(want_state, *args)
    got = cpu.gated_delta_rule(state, *args)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # a bf16 unit where the roundings meet
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_convolution_carried_across_steps_equals_it_over_the_whole_sequence():
    """A prompt chunk, one decode token, two tokens (fewer than the taps), then the rest,
    each from the state the last left on the sequence's slot: the outputs over the whole
    sequence. A fresh sequence beside it starts from zeros, whatever its slot held."""
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(13, 6, generator=gen), torch.randn(4, 6, generator=gen)  # [n, C], [k, C]
    whole = F.silu(F.conv1d(x.t()[None], weight.t()[:, None], padding=3, groups=6)[..., :13])[0].t()
    state = torch.randn(3, 3, 6, generator=gen)  # [slot, last 3 inputs, channel]
    other = torch.randn(4, 6, generator=gen)
    got, fresh = [], torch.tensor([True, True])
    for lo, hi in ((0, 5), (5, 6), (6, 8), (8, 13)):
        rows = torch.cat([x[lo:hi], other])
        out = reference.conv(state, torch.tensor([1, 2]), fresh, torch.tensor([0, hi - lo, hi - lo + 4]), rows, weight)
        got.append(out[:hi - lo])
        if lo == 0:
            alone = F.silu(F.conv1d(other.t()[None], weight.t()[:, None], padding=3, groups=6)[..., :4])[0].t()
            torch.testing.assert_close(out[hi - lo:], alone)
        fresh = torch.tensor([False, False])
    torch.testing.assert_close(torch.cat(got), whole)
    torch.testing.assert_close(state[1], x[10:])


@pytest.mark.parametrize("silu", [True, False])  # Qwen3.5's convolution, LFM2's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_convolution_equals_the_reference(dtype, silu):
    """kernels/csrc/linear_attention.cpp's conv on decode tokens and prompts (one shorter
    than the taps), fresh or carried: the outputs (rounded as a conv1d in the dtype rounds
    them, then SiLU) and the states."""
    gen = torch.Generator().manual_seed(4)
    channels = 1037  # two spans of 512 channels and a tail
    state = torch.randn(6, 3, channels, generator=gen).to(dtype)
    slots, fresh = torch.tensor([4, 1, 2, 5, 0]), torch.tensor([False, True, False, True, False])
    starts = torch.tensor([0, 1, 2, 3, 20, 22])
    x, weight = torch.randn(22, channels, generator=gen).to(dtype), torch.randn(4, channels, generator=gen).to(dtype)
    want_state = state.clone()
    want = reference.conv(want_state, slots, fresh, starts, x, weight, silu)
    got = cpu.conv(state, slots, fresh, starts, x, weight, silu)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # a bf16 unit where two roundings meet
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
