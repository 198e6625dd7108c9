"""GGUF files of every architecture llama.cpp converts that the engine serves (Llama,
SmolLM3, Granite, Arcee, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2 and 3,
EXAONE 4, ERNIE 4.5, GLM-4, Command R and R7B, StarCoder2, Nemotron, StableLM, Apertus,
and Qwen2-MoE, Qwen3-MoE, OLMoE, ERNIE 4.5 MoE, GLM-4.5 and dots.llm1 with each layer's
experts merged, Mixtral, gpt-oss):
tiny ones written as llama.cpp's converter writes them, loaded by the engine and run
greedy in fp32 against transformers on the checkpoint they were written from; and with
`quantization: gguf`, computing on the file's blocks (Q8_0, Q5_0, Q5_1, gpt-oss's MXFP4;
Qwen3.5's and LFM2's state-keeping layers among them), against the engine on the same
file's dequantized values."""

from __future__ import annotations

import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.errors import ParamError
from engine.models import gguf_config, gguf_llama_keyed
from tests.support import arch_models, gguf_files
from tests.support.oracle import engine_greedy, hf_greedy


# What a GGUF carries of each architecture: no windows on Qwen (llama.cpp writes none), and
# Gemma 3's fixed pattern (five local layers, then a global one) with the local layers on
# llama.cpp's fixed base.
GGUF_OVERRIDES = {
    # Llama 3's rope scaling, which llama.cpp files as a tensor of divisors (rope_freqs.weight),
    # with two of the tiny model's eight frequencies between its cuts.
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # llama.cpp's SmolLM3 has no windows, and no rotary on every fourth layer (the config's default).
    "smollm3": dict(use_sliding_window=False, sliding_window=None, num_hidden_layers=4, no_rope_layers=None),
    "granite": dict(attention_bias=False),  # llama.cpp's Granite carries no biases
    "qwen2": dict(use_sliding_window=False, sliding_window=None),
    "qwen3": dict(use_sliding_window=False, sliding_window=None),  # with its YaRN
    "gemma": dict(),
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": dict(query_pre_attn_scalar=16, rope_local_base_freq=10000.0, layer_types=None,
                        num_hidden_layers=6),
    "phi3": dict(),
    # llama.cpp's MoE files: experts on every layer (no mlp_only_layers), stacked per layer;
    # intermediate sizes in whole 32-value blocks, so that the quantized files quantize them.
    "qwen3_moe": dict(mlp_only_layers=[], moe_intermediate_size=64),
    "qwen2_moe": dict(moe_intermediate_size=64),
    # Mixtral is filed as `llama`, which carries no window; gpt-oss's MXFP4 needs whole 32-value
    # blocks, and llama.cpp fixes its SwiGLU clamp at the released models' 7.
    "mixtral": dict(sliding_window=None),
    "gpt_oss": dict(intermediate_size=64, swiglu_limit=7.0),
    "olmo2": dict(),
    # llama.cpp's OLMo 3: one rope base for both kinds of layer, YaRN (with its attention
    # factor away from the default) on the global ones only.
    "olmo3": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 64,
                                                      "attention_factor": 1.5}}),
    "exaone4": dict(),
    "ernie4_5": dict(),
    "glm4": dict(partial_rotary_factor=0.25),  # not the config's default half: the file's must be read
    "cohere": dict(),
    # llama.cpp's Command R7B: every fourth layer global, as the config's default has it.
    "cohere2": dict(num_hidden_layers=4, layer_types=None),
    "arcee": dict(),
    "starcoder2": dict(sliding_window=None),  # its converter writes no window
    "nemotron": dict(partial_rotary_factor=0.25),  # not the config's default half: the file's must be read
    "olmoe": dict(intermediate_size=64),  # whole 32-value blocks
    "stablelm": dict(),
    "apertus": dict(),
    "hunyuan_v1_dense": dict(),
    # llama.cpp's MoE layers run to the last; no expert groups (GLM-4.5's and dots.llm1's
    # converters write none); dots.llm1 without windows (its converter writes none).
    "ernie4_5_moe": dict(moe_intermediate_size=64),
    "glm4_moe": dict(moe_intermediate_size=64, n_group=1, topk_group=1, partial_rotary_factor=0.25),
    "dots1": dict(moe_intermediate_size=64, sliding_window=None),
    "ministral3": dict(sliding_window=None),  # its converter writes no window
    "granitemoe": dict(intermediate_size=64),  # whole 32-value blocks
    "granitemoeshared": dict(intermediate_size=64, shared_intermediate_size=64),
    "qwen3_5_text": dict(),  # two key heads shared by four value heads: the converter's tiling undone
    "qwen3_5_moe_text": dict(moe_intermediate_size=64),
    "lfm2": dict(),  # its MLP size derived (192 -> 128): the file holds the derived one
    # Qwen3-Next: its qkvz and ba projections split and kept as its converter writes them;
    # experts on every layer (llama.cpp names no dense MLP for it), top k renormalised
    "qwen3_next": dict(moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[]),
    # LFM2-MoE: the renormalisation on and no scale, which its converter does not write
    "lfm2_moe": dict(moe_intermediate_size=64, routed_scaling_factor=1.0),
}


@pytest.fixture(autouse=True, scope="module")
def _conversions_in_this_run(tmp_path_factory):
    """These files are written afresh by each run: their fp32 conversions stay in the run's
    temporary directory, which pytest removes, rather than piling up in the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("pagedserve-cache")))
        yield


@pytest.fixture(scope="module")
def written(tmp_path_factory, default_model_dir):
    made = {}

    def make(model_type: str, qtype: str = "F32", keep: dict[str, str] | None = None):
        key = model_type, qtype, tuple(sorted((keep or {}).items()))
        if key not in made:
            root = tmp_path_factory.mktemp(f"{model_type}-{qtype}")
            hf_dir = arch_models.build(model_type, root / "hf", default_model_dir, vocab_size=gguf_files.VOCAB,
                                       **GGUF_OVERRIDES[model_type])
            gguf = gguf_files.write(hf_dir, root / f"{model_type}.gguf", qtype, keep=keep)
            made[key] = hf_dir, gguf
        return made[key]

    return make


def prompts_for(model_type: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(zlib.crc32(model_type.encode()))
    return torch.randint(3, gguf_files.VOCAB, (4, 30), generator=gen).tolist()


@pytest.mark.parametrize("model_type", sorted(gguf_files.GGUF_ARCH))
def test_a_gguf_gives_transformers_tokens_on_its_checkpoint(model_type, written):
    hf_dir, gguf = written(model_type)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    assert llm.engine.hf_config.model_type == model_type
    prompts = prompts_for(model_type)
    assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)
    if gguf_config.file_arch(gguf) in gguf_llama_keyed.BUILDERS:  # configs rebuilt from the keys, beyond greedy
        got = llm.engine.hf_config
        for field in RESTORED:
            if field in NOT_RESTORED.get(model_type, ()):
                continue
            if hasattr(type(hf.config), field):  # a field of its class, not a stray kwarg of the build
                want = getattr(hf.config, field)
                assert getattr(got, field) == (pytest.approx(want) if isinstance(want, float) else want), field


# Config fields a rebuilt config must carry over: a logit scale changes no argmax, but it
# changes every logprob and every sampled token.
RESTORED = ("logit_scale", "layer_norm_eps", "rms_norm_eps", "norm_eps", "layer_types", "sliding_window",
            "attention_bias", "use_bias", "tie_word_embeddings", "head_dim", "rope_parameters")
# ... but for HunYuan, whose converter writes its NTK alpha as the stretched base it gives:
# the same rotary under other parameters.
NOT_RESTORED = {"hunyuan_v1_dense": ("rope_parameters",)}


def test_a_gpt_oss_gguf_with_mxfp4_experts_gives_transformers_tokens(tmp_path, default_model_dir):
    """llama.cpp keeps gpt-oss's experts in GGML's MXFP4: the engine dequantizes them with the
    rest; transformers runs on the same values (the gguf package's own MXFP4 round trip)."""
    import gguf
    from safetensors.torch import load_file, save_file

    hf_dir = arch_models.build("gpt_oss", tmp_path / "hf", default_model_dir, vocab_size=gguf_files.VOCAB,
                               **GGUF_OVERRIDES["gpt_oss"])
    path = gguf_files.write(hf_dir, tmp_path / "gpt_oss.gguf", mxfp4_experts=True)
    weights = load_file(hf_dir / "model.safetensors")
    kind = gguf.GGMLQuantizationType.MXFP4
    for name in [n for n in weights if n.endswith(("gate_up_proj", "down_proj"))]:
        w = weights[name].transpose(1, 2).contiguous().numpy()  # [E, out, in]: blocks run along `in`
        rounded = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind)
        weights[name] = torch.from_numpy(rounded.copy()).transpose(1, 2).contiguous()
        assert not torch.equal(weights[name], load_file(hf_dir / "model.safetensors")[name])
    save_file(weights, hf_dir / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    assert llm.engine.hf_config.model_type == "gpt_oss"
    prompts = prompts_for("gpt_oss")
    assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)


def test_gpt_oss_computes_on_its_mxfp4_blocks(tmp_path, default_model_dir):
    """With `quantization: gguf` the experts stay in MXFP4 (with their biases beside them)
    and the rest on Q8_0, as in a file llama.cpp quantized: the tokens of the same file's
    dequantized values. A scale byte of 255 (NaN in E8M0) is refused naming its tensor."""
    import gguf
    import numpy as np

    hf_dir = arch_models.build("gpt_oss", tmp_path / "hf", default_model_dir, vocab_size=gguf_files.VOCAB,
                               **GGUF_OVERRIDES["gpt_oss"])
    path = gguf_files.write(hf_dir, tmp_path / "gpt_oss.gguf", "Q8_0", mxfp4_experts=True)
    prompts = prompts_for("gpt_oss")
    dense = LLM(str(path), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    want = engine_greedy(dense, prompts, 12, ignore_eos=True)
    del dense
    blocks = LLM(str(path), dtype="float32", max_model_len=64, block_size=8, quantization="gguf")
    experts = blocks.engine.executor.runner.model.layers[0].mlp.expert_modules[0]
    assert [m.qtype for m in experts] == [gguf.GGMLQuantizationType.MXFP4] * 2  # gate_up, down
    assert all(m.bias is not None for m in experts)
    assert engine_greedy(blocks, prompts, 12, ignore_eos=True) == want
    del blocks

    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    damaged = tmp_path / "damaged.gguf"
    raw = bytearray(path.read_bytes())
    raw[int(t.data_offset) + 17 * 3] = 255  # the fourth block's scale
    damaged.write_bytes(bytes(raw))
    assert np.asarray(t.data).dtype == np.uint8
    for quantization in (None, "gguf"):
        with pytest.raises(ValueError, match="blk.1.ffn_down_exps.weight.*NaN in E8M0"):
            LLM(str(damaged), dtype="float32", max_model_len=64, quantization=quantization)


def test_a_glm4_moe_gguf_leaves_its_multi_token_prediction_layer_out(tmp_path, default_model_dir):
    """GLM-4.5's converter appends its MTP layer as one more block, counted in block_count
    and named by nextn_predict_layers: the decoder is the layers before it, read from the
    F32 file (transformers' tokens) and computed on a Q8_0 file's blocks (the same file's
    dequantized tokens)."""
    hf_dir = arch_models.build("glm4_moe", tmp_path / "hf", default_model_dir, vocab_size=gguf_files.VOCAB,
                               **GGUF_OVERRIDES["glm4_moe"])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = prompts_for("glm4_moe")
    f32 = gguf_files.write(hf_dir, tmp_path / "mtp-f32.gguf", mtp_layers=1)
    llm = LLM(str(f32), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    assert llm.engine.hf_config.num_hidden_layers == 3
    assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)
    del llm
    q8 = gguf_files.write(hf_dir, tmp_path / "mtp-q8.gguf", "Q8_0", mtp_layers=1)
    dense = LLM(str(q8), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    want = engine_greedy(dense, prompts, 12, ignore_eos=True)
    del dense
    blocks = LLM(str(q8), dtype="float32", max_model_len=64, block_size=8, quantization="gguf")
    assert engine_greedy(blocks, prompts, 12, ignore_eos=True) == want


@pytest.mark.parametrize("model_type, qtype", [("llama", "Q8_0"), ("smollm3", "Q8_0"), ("granite", "Q5_1"),
                                               ("qwen3", "Q8_0"), ("phi3", "Q8_0"), ("gemma3_text", "Q5_0"),
                                               ("qwen2_moe", "Q5_1"), ("mixtral", "Q8_0"), ("olmo3", "Q8_0"),
                                               ("exaone4", "Q5_1"), ("glm4", "Q8_0"),
                                               ("arcee", "Q8_0"), ("starcoder2", "Q8_0"), ("olmoe", "Q8_0"),
                                               ("ernie4_5_moe", "Q8_0"), ("glm4_moe", "Q5_1"), ("dots1", "Q8_0"),
                                               ("ministral3", "Q8_0"), ("granitemoeshared", "Q8_0"),
                                               ("qwen3_5_text", "Q8_0"), ("qwen3_5_moe_text", "Q5_1"),
                                               ("lfm2", "Q8_0"), ("qwen3_next", "Q8_0"), ("lfm2_moe", "Q8_0")])
def test_quantization_gguf_computes_on_the_files_blocks(model_type, qtype, written):
    """Llama's q and k rows come interleaved, beside its rope_freqs.weight, and so do SmolLM3's
    and Granite's, filed under their own names with Llama's tensors; Qwen3's are not
    interleaved, and it carries YaRN keys; Phi-3's projections come fused, Gemma 3's MLP is
    GELU, Qwen2-MoE's experts are merged per layer beside a shared expert, Mixtral's q and k
    are interleaved as a Llama's; OLMo 3's and EXAONE 4's converted by llama.cpp's name map
    alone, GLM-4's with gate and up fused and q/k rows turned to rotate-half's pairs,
    Arcee's and StarCoder2's MLPs without a gate, OLMoE's experts merged, ERNIE 4.5 MoE's,
    GLM-4.5's and dots.llm1's beside a shared expert and a correction bias: each read from the
    blocks as the dequantized path reads them. Q5_0 is what Q4_K_M files hold where a row
    is not a multiple of 256 (Gemma 3 270M, Qwen2.5 0.5B)."""
    _, gguf = written(model_type, qtype)
    prompts = prompts_for(model_type)
    dense = LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    want = engine_greedy(dense, prompts, 12, ignore_eos=True)
    del dense
    quantized = LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization="gguf")
    assert engine_greedy(quantized, prompts, 12, ignore_eos=True) == want


def test_computing_on_the_blocks_converts_only_what_stays_dense(written, tmp_path, monkeypatch):
    """Under `quantization: gguf` the GEMM weights and the embedding are the file's blocks:
    its conversion holds only norms, biases and routers, and no fp32 copy of the GEMMs is
    written (four times the file, on disk and in memory while converting). A parameter
    that neither the directory nor the blocks fill is refused, never left as garbage."""
    from safetensors import safe_open

    from engine.models import gguf_blocks, gguf_convert

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    _, gguf = written("qwen2_moe", "Q5_1")  # q/k/v biases, a router, a shared expert and its gate
    LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization="gguf")
    [rest] = (tmp_path / "cache" / "gguf").iterdir()
    assert rest.name.endswith(gguf_convert.REST)
    with safe_open(rest / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    kept = ("norm.weight", ".bias", "mlp.gate.weight", "mlp.shared_expert_gate.weight")
    assert any(n.endswith(".bias") for n in names) and any(n.endswith("mlp.gate.weight") for n in names)
    assert [n for n in names if not n.endswith(kept)] == []

    real = gguf_blocks.replaced
    monkeypatch.setattr(gguf_blocks, "replaced", lambda name: name == "norm.weight" or real(name))
    with pytest.raises(ParamError, match="no GGUF blocks replaced.*norm.weight"):
        LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization="gguf")


def test_a_file_without_blocks_is_for_the_dense_path(written):
    """An F16 file's GEMM tensors are no blocks: `gguf` is refused naming the type, and
    `auto` serves the dense weights."""
    _, gguf = written("qwen2", "F16")
    with pytest.raises(ParamError) as e:
        LLM(str(gguf), dtype="float32", max_model_len=64, quantization="gguf")
    assert e.value.param == "quantization" and "is F16" in str(e.value)
    llm = LLM(str(gguf), dtype="float32", max_model_len=64, quantization="auto")
    assert llm.engine.config.quantization is None


@pytest.mark.parametrize("model_type, keep", [
    # an F16 part in the fused qkv (its rows interleaved), the embedding and head dense
    ("llama", {"attn_k.weight": "F16", "token_embd.weight": "F32", "output.weight": "BF16"}),
    # the small ssm_alpha/ssm_beta full precision, as published Qwen3.5 quants keep them,
    # beside tiled value heads; out_proj dense under its column order
    ("qwen3_5_text", {"ssm_alpha.weight": "F32", "ssm_beta.weight": "BF16", "ssm_out.weight": "F16"}),
    # dense routed experts' down and a dense part of the shared expert's gate/up
    ("qwen2_moe", {"ffn_down_exps.weight": "F16", "ffn_gate_shexp.weight": "BF16"}),
])
def test_parts_a_file_keeps_unquantized_compute_beside_its_blocks(model_type, keep, written):
    """Quantizers keep some tensors F32, F16 or BF16 beside the blocks; under `gguf` they
    compute dense in fp32 (their exact values) and the rest on the blocks: the tokens of
    the same file dequantized."""
    from engine.models.quantize import DenseRows, QuantLinear

    _, gguf = written(model_type, "Q8_0", keep)
    prompts = prompts_for(model_type)
    dense = LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    want = engine_greedy(dense, prompts, 12, ignore_eos=True)
    del dense
    quantized = LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization="auto")
    assert quantized.engine.config.quantization == "gguf"
    kinds = {type(m) for m in quantized.engine.executor.runner.model.modules()}
    assert {DenseRows, QuantLinear} <= kinds
    assert engine_greedy(quantized, prompts, 12, ignore_eos=True) == want


def test_a_chat_gguf_stops_on_the_turn_end_its_template_writes(written, tmp_path, default_model_dir):
    """A GGUF names one eos; a Gemma chat file's turns end on <end_of_turn>, which only its
    chat template shows. The converted model stops there, as llama.cpp does."""
    from engine.sampling_params import SamplingParams

    # no whitespace: the byte-level vocabulary of these files has no SentencePiece spaces
    template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}:{{ m['content'] }}<end_of_turn>"
                "{% endfor %}<start_of_turn>model:")
    hf_dir = arch_models.build("gemma3_text", tmp_path / "hf", default_model_dir, vocab_size=gguf_files.VOCAB,
                               **GGUF_OVERRIDES["gemma3_text"])
    gguf = gguf_files.write(hf_dir, tmp_path / "chat.gguf", chat_template=template,
                            specials=("<start_of_turn>", "<end_of_turn>"))
    llm = LLM(str(gguf), dtype="float32", max_model_len=64, block_size=8, quantization=None)
    end = llm.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert llm.engine.eos_token_ids == [2, end]
    [out] = llm.chat([[{"role": "user", "content": "hi"}]],
                     SamplingParams(max_tokens=8, temperature=0, logit_bias={end: 100.0}))
    assert out.outputs[0].token_ids == [end] and out.outputs[0].finish_reason == "stop"


def test_a_conversion_is_found_by_the_files_bytes_not_its_path(written, tmp_path, monkeypatch):
    """A reinstalled venv, a moved Bento or a fresh clone holds the same GGUF at a new path:
    its fp32 conversion is found, not made again beside the old one (a path key filled a
    disk that way). New bytes at the same path get their own; a killed conversion's
    leftover is removed by the next one once it is old."""
    import os
    import shutil
    import time

    from engine.models import gguf_convert, loader, packed_linear

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packed_linear, "supported", lambda device, dtype: False)  # the weights stay parameters
    made = []
    convert = gguf_convert.convert_gguf
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda gguf, out, blocks: (made.append(out), convert(gguf, out, blocks)))
    _, qwen2 = written("qwen2")
    _, qwen3 = written("qwen3")
    first = loader.resolve(str(qwen2)).path
    copy = tmp_path / "reinstalled" / qwen2.name
    copy.parent.mkdir()
    shutil.copy(qwen2, copy)
    assert loader.resolve(str(copy)).path == first and made == [first]
    link = tmp_path / "linked" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to(qwen2)
    assert loader.resolve(str(link)) == loader.ModelFiles(first, str(link)) and made == [first]

    stale, live = (tmp_path / "cache" / "gguf" / f"{gguf_convert.TMP_PREFIX}{name}" for name in ("killed", "running"))
    stale.mkdir(), live.mkdir()
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    shutil.copy(qwen3, copy)  # other bytes at the same path
    other = loader.resolve(str(copy)).path
    assert other != first and made == [first, other]
    assert loader.load_config(loader.ModelFiles(other, str(copy))).model_type == "qwen3"
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == sorted([first.name, other.name, live.name])


@pytest.mark.parametrize("model_type, qtype", [("qwen2_moe", "Q5_1"), ("phi3", "Q8_0"), ("mixtral", "F16"),
                                               ("gemma3_text", "BF16"), ("olmo3", "Q8_0"), ("qwen3_5_text", "Q8_0"),
                                               ("lfm2", "Q8_0"), ("qwen3_next", "Q8_0"), ("lfm2_moe", "Q8_0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_weights_read_from_the_blocks_are_the_fp32_conversions(model_type, qtype, dtype, written, tmp_path,
                                                                       monkeypatch):
    """Without `quantization: gguf` the engine dequantizes the file's GEMM tensors into the
    dense model at load, in the model's dtype, instead of reading an fp32 copy of the whole
    model from the cache: every parameter is the one the fp32 conversion gives, to the bit
    (Qwen2-MoE's experts and shared expert, Phi-3's fused projections, Mixtral's interleaved
    q/k and merged experts, OLMo 3's renamed tensors; F16 and BF16, which no kernel reads,
    through the gguf package),
    and only the small conversion is written. (A router the model keeps in fp32, LFM2-MoE's,
    is no GEMM weight of the file's: it comes from the conversion either way.)"""
    from engine.models import gguf_blocks, gguf_convert, loader, packed_linear

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packed_linear, "supported", lambda device, dtype: False)  # the weights stay parameters
    _, gguf = written(model_type, qtype)
    config = loader.load_config(loader.resolve(gguf, blocks=True))
    [rest] = (tmp_path / "cache" / "gguf").iterdir()
    assert rest.name.endswith(gguf_convert.REST)
    read = loader.build_model(loader.resolve(gguf, blocks=True), config, dtype, torch.device("cpu"), 64)
    converted = loader.build_model(loader.resolve(gguf, blocks=False), config, dtype, torch.device("cpu"), 64)
    got, want = dict(read.named_parameters()), dict(converted.named_parameters())
    assert got.keys() == want.keys() and any(name.endswith(".qkv_proj.weight") for name in got)
    assert [name for name in want if not torch.equal(got[name], want[name])
            or (gguf_blocks.replaced(name) and got[name].dtype != dtype)] == []


@pytest.mark.parametrize("pre, text, merge, merged", [
    ("command-r", " 1", "Ġ1", False),  # Command R, SmolLM, StarCoder: every digit its own piece
    ("glm4", "12345", "34", False),  # GLM-4 (Llama 3's split): runs of three digits, 123 | 45
    ("glm4", "(ab", "(a", True),  # ... and one leading mark kept on its word
    ("stablelm2", "12", "12", False),  # StableLM 2 (Qwen2's split): every digit its own piece
    ("hunyuan-dense", "12345", "34", False),  # HunYuan: digit runs of three first, 123 | 45
])
def test_a_gguf_vocabulary_is_split_as_it_was_trained(pre, text, merge, merged, tmp_path, default_model_dir):
    """A BPE vocabulary's merges never cross the pieces its pre-tokenizer cut.
    transformers' reader knows neither of these splits and cuts GPT-2's way (whole digit
    runs, marks apart from words), so a merge applies there that the model never saw, or
    one it saw does not. The engine splits as llama.cpp does for the file's
    `tokenizer.ggml.pre`; the same vocabulary marked `gpt-2` gets GPT-2's split."""
    from engine.models import loader

    hf_dir = arch_models.build("llama", tmp_path / "hf", default_model_dir, vocab_size=gguf_files.VOCAB)
    merges = ("Ġ Ġ", "Ġ 1", "3 4", "( a", "1 2")

    def pieces(pre_name: str) -> list[str]:
        path = gguf_files.write(hf_dir, tmp_path / f"{pre_name}.gguf", pre=pre_name, merges=merges)
        tok = loader.load_tokenizer(loader.resolve(str(path), blocks=True))
        return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))

    assert (merge in pieces(pre)) is merged
    assert (merge in pieces("gpt-2")) is not merged


def test_an_expert_file_without_its_counts_is_refused_naming_the_key():
    """A GGUF whose expert keys are missing or hold no count: a ParamError naming the key,
    not a TypeError from deep in the config."""
    for get in (lambda key, default=None: default, lambda key, default=None: "eight" if key == "expert_count" else 2):
        with pytest.raises(ParamError) as e:
            gguf_llama_keyed._deepseek_moe(get)
        assert e.value.param == "model" and "'expert_count'" in str(e.value)
