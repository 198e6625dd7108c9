"""The gated delta rule's two forms against its definition, token by token: the chunked
prompt form over several chunks and a partial one, from a state a previous chunk left,
and the batched decode step; and the causal convolution carried across windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.layers import delta_rule


def _definition(state, q, k, v, g, beta):
    """S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q, one token at a time
    ([H, n, d] inputs, [H, dk, dv] state)."""
    state = state.clone()
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", state, k[:, t]))
        state = state + torch.einsum("hk,hv->hkv", k[:, t], u)
        out.append(torch.einsum("hkv,hk->hv", state, q[:, t]))
    return torch.stack(out, dim=1), state


def _inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(heads, n, dk, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(heads, n, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(heads, n, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(heads, n, generator=gen, dtype=torch.float64) * 2  # decays in (exp(-2), 1]
    beta = torch.rand(heads, n, generator=gen, dtype=torch.float64)
    state = torch.randn(heads, dk, dv, generator=gen, dtype=torch.float64)
    return state, q, k, v, g, beta


def test_chunked_equals_the_definition_across_chunks_and_from_a_carried_state():
    state, q, k, v, g, beta = _inputs(19)
    want_out, want_state = _definition(state, q, k, v, g, beta)
    for chunk in (4, 7, 64):  # several whole chunks and a partial one; one chunk for all
        out, last = delta_rule.chunked(state, q, k, v, g, beta, chunk=chunk)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(last, want_state)
    # two calls, the second from the state the first left: a prompt taken in two steps
    out1, mid = delta_rule.chunked(state, q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], chunk=4)
    out2, last = delta_rule.chunked(mid, q[:, 11:], k[:, 11:], v[:, 11:], g[:, 11:], beta[:, 11:], chunk=4)
    torch.testing.assert_close(torch.cat([out1, out2], dim=1), want_out)
    torch.testing.assert_close(last, want_state)


def test_the_decode_step_updates_each_sequence_in_place():
    seqs = [_inputs(1, seed=s) for s in range(4)]
    state = torch.stack([s[0] for s in seqs])
    q, k, v, g, beta = (torch.stack([s[i][:, 0] for s in seqs]) for i in range(1, 6))
    out = delta_rule.step(state, q, k, v, g, beta)
    for i, (s0, *rest) in enumerate(seqs):
        want_out, want_state = _definition(s0, *rest)
        torch.testing.assert_close(out[i], want_out[:, 0])
        torch.testing.assert_close(state[i], want_state)


def test_prepare_norms_scales_and_shares_key_heads_among_value_heads():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    v = torch.randn(5, 4, 8, generator=gen)
    pq, pk, pv = delta_rule.prepare(q, k, v, heads=4)
    assert pq.shape == pk.shape == (5, 4, 16) and pv.dtype == torch.float32
    torch.testing.assert_close(pk.norm(dim=-1), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(pq.norm(dim=-1), torch.full((5, 4), 16 ** -0.5), atol=1e-5, rtol=0)
    torch.testing.assert_close(pk[:, 0], pk[:, 1])  # key head 0 serves value heads 0 and 1
    torch.testing.assert_close(pk[:, 2], F.normalize(k[:, 1], dim=-1, eps=0), atol=1e-5, rtol=0)


def test_the_convolution_carried_across_windows_equals_it_over_the_whole_sequence():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(6, 13, generator=gen), torch.randn(6, 4, generator=gen)
    whole = F.silu(F.conv1d(x[None], weight[:, None], padding=3, groups=6)[..., :13])[0]
    state, parts = torch.zeros(6, 3), []
    for lo, hi in ((0, 5), (5, 6), (6, 13)):  # a chunk, one decode token, the rest
        window = torch.cat([state, x[:, lo:hi]], dim=-1)
        parts.append(delta_rule.conv_window(window[None], weight)[0])
        state = window[:, -3:]
    torch.testing.assert_close(torch.cat(parts, dim=-1), whole)
