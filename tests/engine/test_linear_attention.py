"""Qwen3.5's linear-attention layers in the engine: the per-sequence state slots under forks
(n > 1, beams), slot reuse, the prefix cache held off, the cache budget, what such a model
refuses by name, the multimodal checkpoint's language model, and int8 weights (LFM2's
short convolutions too); each against transformers on a tiny random checkpoint
(tests/support/arch_models.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from engine import LLM, BeamSearchParams, SamplingParams
from engine.errors import ParamError
from engine.models import registry
from engine.models.decoder import kv_block_bytes
from scripts.beam_oracle import hf_beams
from tests.support import arch_models
from tests.support.oracle import engine_greedy, hf_greedy

MODEL = "qwen3_5_text"


@pytest.fixture(scope="module")
def path(tmp_path_factory, default_model_dir):
    return arch_models.build(MODEL, tmp_path_factory.mktemp(MODEL), default_model_dir)


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), dtype="float32", max_num_seqs=8, max_model_len=128, block_size=8)


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (count, length), generator=gen).tolist()


def test_forks_and_beams_carry_their_parents_state(llm, hf):
    """n = 3 forks the prompt's sequence after its prefill: each fork starts from a copy of
    the parent's state, so every one of the three greedy continuations is transformers'.
    Beams fork and drop at every step; theirs equal transformers' beam search."""
    prompts = _prompts(2, 21, 1)
    want = hf_greedy(hf, prompts, 10, None)
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w] * 3 for w in want]
    for prompt in prompts:
        got = llm.beam_search([prompt], BeamSearchParams(3, 8, ignore_eos=True))[0]
        want_beams, _ = hf_beams(hf, prompt, 3, 1.0, [-1], 8)
        assert [s.output_token_ids for s in got.sequences] == want_beams
    states = llm.engine.kv_manager.states
    assert states.num_free == states.num_slots  # every slot back


def test_a_reused_slot_starts_from_zeros(llm, hf):
    """After long sequences leave their states in the slots, one-token prompts (a decode
    row from position 0) and short ones are computed from zeros, not from what was left."""
    llm.generate(_prompts(8, 40, 2), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    prompts = [[p[0]] for p in _prompts(4, 1, 3)] + _prompts(4, 5, 4)
    want = [hf_greedy(hf, [p], 8, None)[0] for p in prompts]  # unpadded, one at a time
    assert engine_greedy(llm, prompts, 8, ignore_eos=True) == want


def test_the_prefix_cache_is_off_and_the_same_prompt_is_computed_again(llm, hf):
    """Cached KV blocks cannot restore a linear layer's state: a prompt sent twice is
    computed twice (no hit counted) and gives transformers' tokens both times."""
    prompt = _prompts(1, 40, 5)
    before = llm.stats().prefix_cache_hit_tokens
    first, second = engine_greedy(llm, prompt, 6, ignore_eos=True), engine_greedy(llm, prompt, 6, ignore_eos=True)
    assert first == second == hf_greedy(hf, prompt, 6, None)
    assert llm.stats().prefix_cache_hit_tokens == before


def test_the_states_come_out_of_the_cache_budget_and_kv_counts_attention_layers_only(path, hf):
    """Only the attention layer keeps KV, so a block is a third of a three-layer model's;
    the states of max_num_seqs sequences are set aside first. A budget too small for them
    is refused naming it."""
    config = hf.config
    linear = registry.state_layers(config)
    assert kv_block_bytes(config, 8, torch.float32) == 2 * 8 * 2 * 32 * 4  # K and V of one layer: 8 x 2 heads x 32
    states = 4 * linear.state_bytes(torch.float32)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_model_len=64, block_size=8,
              kv_cache_memory_bytes=states + 16 * kv_block_bytes(config, 8, torch.float32))
    assert llm.stats().blocks_total == 16
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_num_seqs=4, max_model_len=64, block_size=8, kv_cache_memory_bytes=states)
    assert e.value.param == "kv_cache_memory_bytes" and "max_num_seqs" in str(e.value)


@pytest.mark.parametrize("field,value", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("tensor_parallel_size", 2),
    ("pipeline_parallel_size", 3),
])
def test_what_a_state_cannot_do_is_refused_by_name(path, field, value):
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64, **{field: value})
    assert e.value.param == field and "state-keeping" in str(e.value)


def test_the_multimodal_checkpoints_language_model_is_served(tmp_path, default_model_dir):
    """A Qwen3_5ForConditionalGeneration checkpoint (what Qwen ships): its language model
    under model.language_model., its vision tower left unloaded; equal to the multimodal
    model's own generate on text (its M-RoPE sections all reading the text positions)."""
    text = {**arch_models.BASE, **arch_models.ARCHS[MODEL]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    arch_models.perturb(model, MODEL)
    model.save_pretrained(tmp_path)
    for name in arch_models.TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, tmp_path / name)
    prompts = _prompts(3, 25, 6)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, block_size=8)
    assert engine_greedy(llm, prompts, 8, ignore_eos=True) == hf_greedy(model, prompts, 8, None)


def test_the_default_budget_runs_as_many_sequences_as_half_of_it_holds_states_for(path, hf, monkeypatch):
    """max_num_seqs left at its default (64): where 64 states would take more than half the
    default cache budget (a Qwen3.5-4B's would take 3.3 GB of the CPU's 2 GiB), the engine
    runs as many sequences as half of it holds, rather than refusing to start; more prompts
    than that wait their turn, and an n above it is refused naming n."""
    from engine import config as engine_config

    per_sequence = registry.state_layers(hf.config).state_bytes(torch.float32)
    monkeypatch.setattr(engine_config, "CPU_KV_DEFAULT_BYTES", 12 * per_sequence)
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=8)
    assert llm.engine.max_num_seqs == 6
    assert llm.stats().blocks_total == 6 * per_sequence // kv_block_bytes(hf.config, 8, torch.float32)
    prompts = _prompts(10, 20, 7)
    assert engine_greedy(llm, prompts, 6, ignore_eos=True) == hf_greedy(hf, prompts, 6, None)
    with pytest.raises(ParamError) as e:
        llm.generate([prompts[0]], SamplingParams(n=7, max_tokens=2), use_tqdm=False)
    assert e.value.param == "n"


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2"])
def test_int8_computes_the_state_keeping_layers_on_their_rounded_weights(model_type, tmp_path, default_model_dir):
    """`quantization: int8` puts the linear attention's and the short convolution's
    projections on int8 blocks, as every other GEMM: greedy output is transformers' on the
    same checkpoint with each quantized weight replaced by the values its int8 rows stand
    for (the routers stay dense, as the engine keeps them)."""
    from torch import nn

    from engine.models.quantize import ROUTERS, QuantLinear
    from kernels import quant

    path = arch_models.build(model_type, tmp_path / model_type, default_model_dir)
    llm = LLM(str(path), dtype="float32", quantization="int8", max_model_len=64, block_size=8)
    layers = llm.engine.executor.runner.model.layers
    mixers = [m for layer in layers if layer.is_linear for m in (layer.mixer.in_proj, layer.mixer.out_proj)]
    assert mixers and all(isinstance(m, QuantLinear) for m in mixers)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rounded = [m.weight for name, m in hf.named_modules() if isinstance(m, nn.Linear) and not name.endswith(ROUTERS)]
    with torch.no_grad():
        for w in {id(w): w for w in [*rounded, hf.get_input_embeddings().weight]}.values():
            w.copy_(quant.dequantize(*quant.quantize_int8(w), quant.INT8_ROWS, w.shape[1]))
    prompts = _prompts(3, 20, 5)
    assert engine_greedy(llm, prompts, 8, ignore_eos=True) == hf_greedy(hf, prompts, 8, None)
