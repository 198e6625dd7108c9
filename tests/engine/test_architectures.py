"""Every supported architecture, greedy in fp32, token for token against transformers on
tiny random checkpoints whose windows are shorter than the prompts: under preemption and
chunked prefill, on the native CPU kernels and on the torch reference path; the fused
layer's architectures also on the Triton kernels a GPU runs (here in Triton's interpreter)."""

from __future__ import annotations

import zlib

from tests.support.kernel_checks import NATIVE  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.errors import ParamError
from engine.models import registry
from engine.models.decoder import kv_block_bytes
from tests.support import arch_models
from tests.support.oracle import engine_greedy, hf_greedy


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory, default_model_dir):
    made = {}

    def make(model_type: str):
        if model_type not in made:
            made[model_type] = arch_models.build(model_type, tmp_path_factory.mktemp(model_type), default_model_dir)
        return made[model_type]

    return make


# The Triton path's fused layer (kernels/triton_fused.py) under q/k norms and YaRN (qwen3),
# sandwich norms with fp32 weights, GELU and two rope bases (gemma3_text), a partial
# rotary (phi3), and norms after each block only with NoPE global layers (exaone4); on a
# GPU the gpu tier runs it natively.
TRITON = [] if NATIVE else ["gemma3_text", "phi3", "qwen3", "exaone4"]
CASES = [(m, b) for m in sorted(arch_models.ARCHS) for b in ("native", "torch")] + [(m, "triton") for m in TRITON]


@pytest.mark.parametrize("model_type,backend", CASES)
def test_architecture_matches_transformers(model_type, backend, arch_dir):
    path = arch_dir(model_type)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(zlib.crc32(model_type.encode()))
    prompts = torch.randint(3, 49152, (8, 30), generator=gen).tolist()  # 30 > the 12-token window
    new = 16
    # 16 blocks of 8 tokens for 8 sequences of 46: preemption; a 40-token budget chunks prompts.
    # (Besides the 8 sequences' states where the model has linear-attention layers.)
    blocks, budget = 16, 40
    if backend == "triton":
        # The interpreter runs every kernel instance in numpy (30-50 s a model for the case
        # above, on 2 cores); the layer's arithmetic is what it checks, on prompts past the window, while
        # the native and torch cases check the scheduling around it. 40 tokens of budget still
        # chunk the 30-token prompts that share a step.
        prompts, new, blocks = prompts[:3], 8, 3 * 5
    linear = registry.state_layers(hf.config)
    states = len(prompts) * linear.state_bytes(torch.float32) if linear is not None else 0
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
              kv_cache_memory_bytes=blocks * kv_block_bytes(hf.config, 8, torch.float32) + states, block_size=8,
              attention_backend=backend)
    got = engine_greedy(llm, prompts, new, ignore_eos=True)
    want = hf_greedy(hf, prompts, new, None)
    assert got == want
    stats = llm.stats()
    assert stats.num_preemptions > 0 or backend == "triton"
    assert stats.blocks_free == stats.blocks_total


def test_an_activation_the_architecture_does_not_compute_is_refused_by_name(tmp_path, default_model_dir):
    """A Llama-shaped checkpoint trained with GELU, served with Llama's SiLU, would give
    other tokens and no error."""
    path = arch_models.build("llama", tmp_path / "gelu", default_model_dir, hidden_act="gelu")
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64)
    assert e.value.param == "model" and "hidden_act 'gelu'" in str(e.value)


def test_an_unknown_architecture_is_refused_by_name():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt2")
    with pytest.raises(ParamError) as e:
        registry.text_config(config)
    assert e.value.param == "model" and "'gpt2'" in str(e.value) and "qwen3" in str(e.value)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", ["gemma2", "qwen2", "qwen2_moe", "gpt_oss", "starcoder2", "ernie4_5_moe"])
def test_tensor_parallel_windowed_and_biased_architectures_match_transformers(model_type, arch_dir):
    """Gemma 2 (windows on alternate layers, soft-caps, four norms a layer), Qwen2 (QKV
    biases split with their heads, windows on its upper layers), Qwen2-MoE (every
    expert's intermediate split across the ranks, and its shared expert's), gpt-oss
    (sinks split with their heads, expert biases: gate/up's split, down's added once) and
    StarCoder2 (an MLP without a gate, its up rows and biases split, LayerNorm biases)
    and ERNIE 4.5 MoE (an fp32 router with its choice bias on every rank, a shared
    expert without a gate, the LM head's bias split with the vocabulary) over two tensor
    ranks."""
    path = arch_dir(model_type)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(zlib.crc32(model_type.encode()) + 1)
    prompts = torch.randint(3, 49152, (6, 30), generator=gen).tolist()
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=8, tensor_parallel_size=2)
    try:
        assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)
    finally:
        llm.shutdown()


def test_command_r_plus_per_head_layernorm_is_refused_by_name(tmp_path, default_model_dir):
    """Command R+ norms q and k with a LayerNorm weight per head, which no layer here has:
    refused naming the key, rather than served without it."""
    path = arch_models.build("cohere", tmp_path, default_model_dir, use_qk_norm=True)
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64)
    assert e.value.param == "model" and "use_qk_norm" in str(e.value)


def test_olmo2_refuses_tensor_parallelism_by_name(arch_dir):
    """Its q/k norm spans every head: no rank holding some heads can compute it alone."""
    with pytest.raises(ParamError) as e:
        LLM(str(arch_dir("olmo2")), dtype="float32", max_model_len=64, tensor_parallel_size=2)
    assert e.value.param == "tensor_parallel_size" and "olmo2" in str(e.value)


def test_a_rope_base_list_that_does_not_fit_the_layers_is_refused_by_name(tmp_path, default_model_dir):
    """Granite SWA's layer_rope_theta, one base per layer: too few (or a negative one) would
    leave layers without a rotary table, or turn them backwards."""
    from transformers import AutoConfig

    for thetas in ([10000.0, 0], [10000.0, -1.0, 0]):
        config = AutoConfig.for_model("granite_swa", **{**arch_models.BASE, **arch_models.ARCHS["granite_swa"],
                                                          "layer_rope_theta": thetas})
        with pytest.raises(ParamError) as e:
            registry.model_class(config)(config, 64, None)
        assert e.value.param == "model" and "layer_rope_theta" in str(e.value)
