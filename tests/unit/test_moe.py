"""The expert layer (engine/models/layers/moe.py) on the routings that break naive
implementations, against a per-token reference: tied router scores, experts no token
chose, every token on one expert; and the configs it refuses by name."""

from __future__ import annotations

import pytest
import torch

from engine import parallel
from engine.errors import ParamError
from engine.models.arch import MoESpec
from engine.models.layers.moe import SparseMoE


def _layer(experts: int = 4, top_k: int = 2, norm: bool = True, shared: int = 0) -> SparseMoE:
    torch.manual_seed(0)
    spec = MoESpec(experts, top_k, inter=24, norm_topk=norm, layers=frozenset({0}), shared_inter=shared)
    moe = SparseMoE(16, spec, "silu", parallel.single().tp)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def _per_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: its experts' outputs, weighted, summed."""
    experts, weights = moe.route(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for e, w in zip(experts[t].tolist(), weights[t]):
            gate, up = (moe.experts_gate_up[e] @ x[t]).chunk(2)
            acc += w * (moe.experts_down[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    out = torch.stack(rows)
    if moe.spec.shared_inter:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


@pytest.mark.parametrize("shared", [0, 20])
def test_the_expert_layer_equals_a_per_token_reference(shared):
    """Also with the experts prepacked as the CPU engine runs them: all of a layer's in one
    native call where the CPU has the panel GEMM, else each expert's GEMMs on their own."""
    import copy

    from kernels import cpu

    moe = _layer(shared=shared)
    x = torch.randn(37, 16)
    with torch.no_grad():
        want = _per_token(moe, x)
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
        packed = copy.deepcopy(moe)
        packed.pack()
        assert packed.experts_gate_up is None
        if cpu.gemm_available(torch.float32):
            assert packed.native is not None and packed.packed == []
        else:
            assert packed.native is None and len(packed.packed) == 4
        torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x[:1]), want[:1], rtol=1e-5, atol=1e-5)  # a lone token
        assert packed(x[:0]).shape == (0, 16)  # an empty step


def test_tied_scores_unused_experts_and_one_expert_for_every_token():
    moe = _layer(experts=6, top_k=2)
    x = torch.randn(9, 16)
    with torch.no_grad():
        moe.gate.weight.zero_()  # every score tied: the choice is topk's, the same on both sides
        experts, weights = moe.route(x)
        assert torch.allclose(weights, torch.full_like(weights, 0.5))
        assert len(set(experts.flatten().tolist())) < 6  # some experts got no token
        torch.testing.assert_close(moe(x), _per_token(moe, x), rtol=1e-5, atol=1e-5)

        one = _layer(experts=4, top_k=1, norm=False)
        one.gate.weight.zero_()
        one.gate.weight[2] = 0.2  # expert 2 outscores the rest for these (positive) tokens
        xs = x.abs()
        experts, weights = one.route(xs)
        assert experts.flatten().tolist() == [2] * 9 and bool((weights < 1).all())  # not renormalised
        torch.testing.assert_close(one(xs), _per_token(one, xs), rtol=1e-5, atol=1e-5)
        assert one(xs[:0]).shape == (0, 16)  # an empty step


def test_bad_expert_configs_are_refused_by_name():
    from transformers import AutoConfig

    from engine.models import registry

    for model_type, kw, word in (("mixtral", dict(num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
                                 ("qwen3_moe", dict(num_experts=0, num_experts_per_tok=1), "expert"),
                                 # 6 experts in 4 groups, or groups of one (no two best to rank a group by)
                                 ("glm4_moe", dict(n_routed_experts=6, num_experts_per_tok=2, n_group=4,
                                                   topk_group=1), "n_group"),
                                 ("dots1", dict(n_routed_experts=4, num_experts_per_tok=2, n_group=4, topk_group=2,
                                                moe_intermediate_size=8, n_shared_experts=1), "n_group"),
                                 # the kept groups hold fewer experts than the top-k
                                 ("glm4_moe", dict(n_routed_experts=8, n_group=4, topk_group=1,
                                                   num_experts_per_tok=4), "n_group")):
        config = AutoConfig.for_model(model_type, num_hidden_layers=2, **kw)
        with pytest.raises(ParamError) as e:
            registry.model_class(config).spec(config)
        assert e.value.param == "model" and word in str(e.value)


def test_one_token_reads_only_its_top_k_experts():
    """At batch 1 a step multiplies by k experts' weights a layer and by no other expert:
    what makes a 30B-A3B model decode at the cost of a 3B one."""
    import torch.nn.functional as F

    moe = _layer(experts=8, top_k=2)
    x = torch.randn(1, 16)
    expert_ptrs = {moe.experts_gate_up[e].data_ptr(): e for e in range(8)} | \
                  {moe.experts_down[e].data_ptr(): e for e in range(8)}
    touched: list[int] = []
    real = F.linear

    def spy(inp, weight, bias=None):
        if weight.data_ptr() in expert_ptrs:
            touched.append(expert_ptrs[weight.data_ptr()])
        return real(inp, weight, bias)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "linear", spy)
        moe(x)
        chosen, _ = moe.route(x)
    assert sorted(touched) == sorted(chosen[0].tolist() * 2)  # gate/up and down of each chosen expert


def test_a_packed_layer_computes_with_the_chosen_experts_alone():
    """Packed as the CPU engine runs it (all experts in one native call, or a GEMM per
    expert where the CPU lacks the panel GEMM), a step never multiplies in an expert no
    token chose: their weights poisoned with NaN before packing change nothing."""
    moe = _layer(experts=8, top_k=2)
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = _per_token(moe, x)
        chosen = set(moe.route(x)[0].flatten().tolist())
        assert len(chosen) < 8
        for e in set(range(8)) - chosen:
            moe.experts_gate_up[e].fill_(float("nan"))
            moe.experts_down[e].fill_(float("nan"))
        moe.pack()
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(moe(x[:1]), want[:1], rtol=1e-5, atol=1e-5)  # the one-token path too


def test_a_bf16_model_routes_with_its_fp32_router():
    """DeepSeek-V3-style and ERNIE routers stay fp32 in a bf16 model, as transformers keeps
    them: two experts whose router rows differ by less than bf16 can tell apart are still
    told apart, so a token gets the expert its trained router picks."""
    spec = MoESpec(4, 1, inter=8, norm_topk=False, layers=frozenset({0}), fp32_router=True, scoring="sigmoid",
                   choice_bias=True, weights_in_dtype=False)
    moe = SparseMoE(16, spec, "silu", parallel.single().tp)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.gate.choice_bias.zero_()
        row = torch.full((16,), 0.5)
        moe.gate.weight[:2] = -1.0
        moe.gate.weight[2] = row
        moe.gate.weight[3] = row + 1e-4  # the same row in bf16 (1e-4 is under half of 0.5's 2^-9 spacing)
        assert torch.equal(moe.gate.weight[2].bfloat16(), moe.gate.weight[3].bfloat16())
    moe = moe.to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.float32 and moe.experts_gate_up.dtype == torch.bfloat16
    x = torch.ones(3, 16, dtype=torch.bfloat16)
    experts, weights = moe.route(x)
    assert experts.flatten().tolist() == [3, 3, 3]
    assert moe(x).dtype == torch.bfloat16


def test_the_choice_bias_picks_the_experts_but_not_their_weights():
    """e_score_correction_bias balances the load: it moves which experts a token gets,
    while their weights stay the router's own scores (renormalised and scaled)."""
    spec = MoESpec(4, 2, inter=8, norm_topk=True, layers=frozenset({0}), fp32_router=True, scoring="sigmoid",
                   choice_bias=True, weights_in_dtype=False, norm_eps=1e-20, routed_scale=2.5)
    moe = SparseMoE(4, spec, "silu", parallel.single().tp)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(4) * 4.0)
        moe.gate.choice_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    x = torch.tensor([[1.0, 0.8, 0.0, 0.0]])  # scores: expert 0 > 1 > 2 = 3
    experts, weights = moe.route(x)
    scores = torch.sigmoid(x @ moe.gate.weight.t())[0]
    assert sorted(experts[0].tolist()) == [0, 3]  # the bias brought expert 3 in ahead of 1
    picked = scores[experts[0]]
    torch.testing.assert_close(weights[0], picked / picked.sum() * 2.5)


def test_a_lone_token_in_a_bf16_layer_with_fp32_weights_matches_a_batch():
    """Mixtral's and GLM-4.5's routing weights stay fp32; a lone token's experts (the
    decode path without a sort) give the bits a batch's index_add gives, in the layer's
    dtype."""
    from engine.models.arch import MoESpec

    torch.manual_seed(0)
    spec = MoESpec(4, 2, inter=24, norm_topk=True, layers=frozenset({0}), weights_in_dtype=False)
    moe = SparseMoE(16, spec, "gelu_tanh", parallel.single().tp)  # gelu: experts packed one by one
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    moe = moe.to(torch.bfloat16)
    moe.pack()
    x = torch.randn(1, 16).to(torch.bfloat16)
    with torch.no_grad():
        one, batch = moe(x), moe(torch.cat([x, x]))
    assert moe.packed and one.dtype == torch.bfloat16
    assert torch.equal(one[0], batch[0])
