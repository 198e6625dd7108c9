"""Embeddings (engine/pooling.py) against transformers' pooled hidden states on tiny random
checkpoints, in fp32: a Qwen3-Embedding-style checkpoint (a headless Qwen3Model with
sentence-transformers' last-token pooling and Normalize modules) and a Llama pooled by
mean from the config. Embedding requests run in the same steps as generation, through
chunked prefill and preemption, and leave no KV block behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.errors import ParamError
from engine.pooling import PoolerConfig, PoolingParams
from tests.support.arch_models import BASE, TOKENIZER_FILES
from tests.support.prompts import SENTENCES as PROMPTS

TEXTS = ["What is the capital of France?", "Paged attention keeps the KV cache in fixed-size blocks.",
         PROMPTS[0] * 3, "a"]


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory, default_model_dir):
    """A Qwen3-Embedding-shaped checkpoint: Qwen3Model weights (no lm_head, no `model.`
    prefix) and sentence-transformers' modules (last-token Pooling, then Normalize)."""
    from transformers import Qwen3Config, Qwen3Model

    path = tmp_path_factory.mktemp("qwen3_embedding")
    config = Qwen3Config(**{**BASE, "head_dim": 32, "tie_word_embeddings": True, "is_matryoshka": True})
    torch.manual_seed(3)
    model = Qwen3Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path / name)
    return path, model


def _hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states (after the final norm), of a base or a causal LM."""
    base = getattr(model, "model", model)
    with torch.no_grad():
        return base(torch.tensor([ids])).last_hidden_state[0]


def _close(ours: list[float], ref: torch.Tensor) -> None:
    got = torch.tensor(ours)
    assert got.shape == ref.shape
    assert F.cosine_similarity(got, ref, dim=0).item() > 1 - 1e-5
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_last_token_pooling_of_an_embedding_checkpoint_equals_transformers(qwen3_embedding):
    path, hf = qwen3_embedding
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert llm.engine.pooler == PoolerConfig(pooling_type="last", normalize=True, matryoshka=True)
    outs = llm.embed(TEXTS)
    assert [o.prompt for o in outs] == TEXTS
    for out in outs:
        _close(out.embedding, F.normalize(_hidden(hf, out.prompt_token_ids)[-1], dim=0))
    # Matryoshka: cut to 16 dimensions, then normalized again; unnormalized on request.
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=16))[0]
    _close(short.embedding, F.normalize(_hidden(hf, outs[0].prompt_token_ids)[-1][:16], dim=0))
    raw = llm.embed(TEXTS[1], PoolingParams(normalize=False))[0]
    _close(raw.embedding, _hidden(hf, outs[1].prompt_token_ids)[-1])
    with pytest.raises(ParamError) as err:
        llm.embed("x", PoolingParams(dimensions=65))
    assert err.value.param == "dimensions"
    assert llm.engine.kv_manager.pool.num_free == llm.engine.resolved.num_blocks


def test_mean_pooling_runs_beside_generation_through_chunks_and_preemption(tiny_model_factory):
    """Mean pooling over prompts cut into chunks, sharing steps with generation in a pool
    small enough to preempt: vectors equal transformers', generation equal to a run with
    no embedding request, and every block free at the end."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("tiny")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    knobs = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, block_size=8,
                 kv_cache_memory_bytes=16 * 4096)  # 16 blocks of 8 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    alone = LLM(str(path), **knobs).generate(PROMPTS[:4], greedy, use_tqdm=False)

    llm = LLM(str(path), pooler={"pooling_type": "mean", "normalize": False}, **knobs)
    engine = llm.engine
    long_text = " ".join(PROMPTS[:6])  # over 64 tokens: its prefill takes several steps
    texts = [long_text, TEXTS[0], long_text + " again"]
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"g{i}", prompt, greedy)
    for i, text in enumerate(texts):
        engine.add_request(f"e{i}", text, pooling_params=PoolingParams())
    done, vectors, preempted = {}, {}, 0
    while engine.has_unfinished():
        out = engine.step()
        preempted += out.stats.preemptions
        for d in out.outputs:
            if d.pooled is not None:
                vectors[d.request_id] = d.pooled
            elif d.deltas:
                done.setdefault(d.request_id, []).extend(t for c in d.deltas for t in c.token_ids)
    assert preempted > 0, "the pool was meant to be small enough to preempt"
    for i, text in enumerate(texts):
        ids = engine.tokenize(text)
        assert len(ids) > 64 or i == 1
        _close(vectors[f"e{i}"], _hidden(hf, ids).mean(0))
    assert [done[f"g{i}"] for i in range(4)] == [o.outputs[0].token_ids for o in alone]
    assert engine.kv_manager.pool.num_free == engine.resolved.num_blocks


def test_a_model_without_a_pooler_refuses_embeddings_naming_the_model(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("tiny")), dtype="float32", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ParamError) as err:
        llm.embed("hello")
    assert err.value.param == "model"
    with pytest.raises(ParamError) as err:
        LLM(str(tiny_model_factory("tiny")), pooler={"pooling_type": "max"})
    assert err.value.param.startswith("pooler")
