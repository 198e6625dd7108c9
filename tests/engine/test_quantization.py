"""Quantized weights end to end: "gguf" computes on the embedded file's own blocks (the
values the fp32 path dequantizes), "int8" quantizes any checkpoint per output channel,
and whatever cannot be served is refused naming `quantization`."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ParamError
from engine.models import default_model_path, quantize
from kernels import quant
from tests.support.oracle import departs_only_at_near_ties
from tests.support.quality import force_int8_rows, perplexity


KW = dict(max_model_len=512, kv_cache_memory_bytes=128 << 20)
TOPICS = ["rivers", "bread", "the moon", "chess", "volcanoes", "tea", "bicycles", "owls", "glass", "winter",
          "maps", "bees", "violins", "deserts", "trains", "salt", "clocks", "whales", "paper", "storms",
          "gardens", "bridges", "coffee", "lighthouses"]


@pytest.fixture(scope="module")
def fp32() -> LLM:
    return LLM(dtype="float32", **KW)


@pytest.fixture(scope="module")
def gguf_llm() -> LLM:
    return LLM(quantization="gguf", **KW)


def dense_weight(dense) -> torch.Tensor:
    """The fp32 path's packed weight, unpacked: through an identity input, or for a gate/up
    packed with its activation (gemm_pack_glu) from the panels, 24 gate then 24 up rows each."""
    if not getattr(dense, "glu", False):
        return dense(torch.eye(dense.in_features)).T
    p = dense.panels[..., 0].transpose(1, 2)  # [panels, 48 channels, K]
    rows, k = dense.out_features, dense.in_features
    return torch.cat([p[:, :24].reshape(-1, k)[:rows], p[:, 24:].reshape(-1, k)[:rows]])


def model_of(llm: LLM):
    return llm.engine.executor.runner.model


def test_gguf_weights_are_the_files_blocks_with_the_fp32_paths_values(fp32, gguf_llm):
    ref, q = model_of(fp32), model_of(gguf_llm)
    assert quantize.weight_bytes(q) < 100e6  # 96 MB of blocks, where fp32 holds 538 MB
    assert not any(p.dtype == torch.float32 and p.numel() > 1e6 for p in q.parameters())  # no fp32 copy
    for i in (0, 17, len(ref.layers) - 1):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            want = dense_weight(ref.layers[i].get_submodule(name))
            mod = q.layers[i].get_submodule(name)
            assert mod.qtype == quant.Q4_1
            torch.testing.assert_close(mod.dequantized(), want, rtol=0, atol=0)
    assert q.head.qtype == quant.Q8_0
    torch.testing.assert_close(q.head.dequantized(), ref.embed_tokens.weight, rtol=0, atol=0)


def chats(llm: LLM) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": f"Write two sentences about {t}."}])
            for t in TOPICS]


def test_gguf_greedy_output_is_the_fp32_paths(fp32, gguf_llm):
    """The weights are identical, so only the order of fp32 sums differs: at most a
    near-tie between the two best tokens can turn a greedy choice."""
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = chats(fp32)
    want = fp32.generate(prompts, params, use_tqdm=False)
    got = gguf_llm.generate(prompts, params, use_tqdm=False)
    same = sum(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
    assert same >= 22, f"{same} of 24 equal"


def test_int8_activations_cost_little_perplexity(gguf_llm, monkeypatch):
    """Rounding activations to int8 per 32 values is lossy (the kernel's own bound is
    tests/unit/test_quant_a8.py's); what a user relies on is that the model stays as good:
    the embedded model's perplexity with every GEMM row through the int8-activation kernel
    (forced here, prefill included: a decode step is one row) within 2% of the exact
    blocks' (1.2% measured)."""
    a8 = LLM(quantization="gguf", int8_activations=True, **KW)
    layers = [m for m in model_of(a8).modules() if isinstance(m, quantize.QuantLinear)]
    assert layers and all(m.int8_activations for m in layers)  # the head's too
    exact = perplexity(gguf_llm)
    force_int8_rows(monkeypatch)
    rounded = perplexity(a8)
    assert rounded != exact or not quant.few_rows_available(quant.Q4_1, 576)  # the rounding did run
    assert abs(rounded - exact) / exact < 0.02, (exact, rounded)


def test_int8_activations_need_quantized_weights():
    with pytest.raises(ParamError, match="needs quantization") as err:
        LLM(int8_activations=True, dtype="float32", **KW)
    assert err.value.param == "int8_activations"


def test_int8_activations_under_auto_on_dense_weights_is_said(tiny_model_factory, caplog):
    """auto keeps a non-GGUF checkpoint dense; the setting then rounds nothing, and says so."""
    import logging

    model = str(tiny_model_factory("quant-tiny", tie_word_embeddings=False))
    with caplog.at_level(logging.INFO, logger="engine.models.quantize"):
        llm = LLM(model, dtype="float32", quantization="auto", int8_activations=True, **KW)
    assert llm.stats().quantization is None
    assert "int8_activations" in caplog.text


def test_int8_perplexity_is_within_one_percent_of_fp32(fp32):
    int8 = LLM(quantization="int8", **KW)
    assert quantize.weight_bytes(model_of(int8)) < 140e6
    base, q = perplexity(fp32), perplexity(int8)
    assert abs(q - base) / base < 0.01, (base, q)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_quantizes_an_hf_checkpoint(tiny_model_factory, dtype):
    path = str(tiny_model_factory("quant-tiny", tie_word_embeddings=False))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    fp = LLM(path, dtype=dtype, **KW).generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(path, quantization="int8", dtype=dtype, **KW)
    assert isinstance(model_of(llm).head, quantize.QuantLinear)  # the untied head too
    q = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
    assert len(q.token_ids) == 8
    # Random weights make near-ties everywhere; the first token's logprob shows int8 is close.
    assert q.logprobs[0].token_id != fp.logprobs[0].token_id or abs(q.logprobs[0].logprob
                                                                      - fp.logprobs[0].logprob) < 0.05


def test_a_bf16_model_on_the_blocks_departs_from_the_dense_bf16_one_only_at_near_ties():
    """`dtype: bfloat16` with the file's blocks: bf16 activations and KV cache, each GEMM on
    the blocks (many rows on the AMX tiles where the CPU has them, with the weights rounded
    to bf16 as the dense bf16 model holds them; a decode row in fp32 on the exact weights).
    Against the dense bf16 model of the same file, a greedy run may part ways only where
    that rounding turns a near-tie."""
    blocks = LLM(dtype="bfloat16", quantization="gguf", **KW)
    model = model_of(blocks)
    assert quantize.weight_bytes(model) < 100e6 and isinstance(model.head, quantize.QuantLinear)
    assert all(c[0].dtype == torch.bfloat16 for c in blocks.engine.executor.runner.kv_caches)
    assert model.embed_tokens(torch.tensor([1, 2])).dtype == torch.bfloat16
    prompts = chats(blocks)[:12]
    p = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    got = [o.outputs[0] for o in blocks.generate(prompts, p, use_tqdm=False)]
    want = [o.outputs[0] for o in LLM(dtype="bfloat16", **KW).generate(prompts, p, use_tqdm=False)]
    assert departs_only_at_near_ties(want, got) >= 6


@pytest.mark.parametrize("kw, why", [
    (dict(quantization="gguf", tensor_parallel_size=2), "parallelism"),
    (dict(quantization="q3"), "quantization"),
])
def test_what_cannot_be_served_is_refused_naming_quantization(kw, why):
    with pytest.raises(ParamError, match=why) as err:
        LLM(**kw, **KW)
    assert err.value.param == "quantization"


def test_gguf_needs_a_gguf_file(tiny_model_factory):
    with pytest.raises(ParamError, match="not a .gguf") as err:
        LLM(str(tiny_model_factory("quant-tiny", tie_word_embeddings=False)), quantization="gguf", **KW)
    assert err.value.param == "quantization"


def test_a_block_type_without_a_kernel_is_refused(tmp_path, monkeypatch):
    """The embedded file with its embedding rewritten as IQ4_NL, a type no kernel reads."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(default_model_path())
    path = tmp_path / "iq4nl-embedding.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            kind = gguf.GGMLQuantizationType.IQ4_NL
            rows, k = int(t.shape[1]), int(t.shape[0])
            block, size = gguf.GGML_QUANT_SIZES[kind]
            writer.add_tensor(t.name, np.zeros((rows, k // block * size), np.uint8), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # the data's shape is its byte shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ParamError, match="'token_embd.weight' is IQ4_NL") as err:
        LLM(str(path), quantization="gguf", **KW)
    assert err.value.param == "quantization"
    # refused from the file's header, before the loader spent time and disk dequantizing it
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kw, bf16_cpu, want", [
    (dict(dtype="float32"), True, "gguf"),
    (dict(dtype="auto"), False, "gguf"),
    (dict(dtype="auto"), True, None),  # bf16 there: the dense bf16 GEMMs win at many rows
    (dict(dtype="bfloat16"), False, None),
    (dict(dtype="float32", tensor_parallel_size=2), False, None),
])
def test_auto_is_gguf_where_the_activations_are_fp32_anyway(kw, bf16_cpu, want, monkeypatch):
    """The decision alone (reading the file's header is the next two tests' part)."""
    from engine import config as config_module
    from engine.models import gguf_blocks

    monkeypatch.setattr(config_module, "cpu_has_bf16", lambda: bf16_cpu)
    monkeypatch.setattr(gguf_blocks, "preflight", lambda source: None)
    assert quantize.auto(config_module.EngineConfig(device="cpu", quantization="auto", **kw)) == want


def test_auto_keeps_other_checkpoints_dense(tiny_model_factory):
    from engine.config import EngineConfig

    model = str(tiny_model_factory("quant-tiny", tie_word_embeddings=False))
    assert quantize.auto(EngineConfig(model=model, device="cpu", dtype="float32", quantization="auto")) is None


def test_auto_reports_what_it_chose(gguf_llm):
    llm = LLM(dtype="float32", quantization="auto", **KW)
    assert llm.stats().quantization == "gguf"
    assert llm.stats().weight_bytes == gguf_llm.stats().weight_bytes
