"""Relevance scores (engine/scoring.py) against transformers on tiny random checkpoints, in
fp32: a Qwen3ForSequenceClassification cross-encoder (its `score` head, no LM head), and a
Qwen3-Reranker-style yes/no question to a causal LM through a template."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ParamError
from tests.support.arch_models import BASE, TOKENIZER_FILES

QUERY = "Which planet is the largest?"
DOCS = ["Jupiter is the largest planet in our solar system.", "Water boils at 100 degrees Celsius.",
        "The train to Berlin departs at half past seven."]
TEMPLATE = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query. "
            "Answer only \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}"
            "<|im_end|>\n<|im_start|>assistant\n")


def _save(model, path, tokenizer_dir):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def test_a_sequence_classification_checkpoint_scores_as_transformers(tmp_path, default_model_dir, tokenizer):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(5)
    hf = Qwen3ForSequenceClassification(Qwen3Config(**{**BASE, "head_dim": 32, "num_labels": 1})).eval()
    path = _save(hf, tmp_path / "cross_encoder", default_model_dir)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)
    outs = llm.score(QUERY, DOCS)
    for out, doc in zip(outs, DOCS):
        ids = tokenizer(QUERY, text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            want = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item()
        assert out.score == pytest.approx(want, abs=1e-5)
    assert len({round(o.score, 6) for o in outs}) == 3  # the documents really differ
    with pytest.raises(ParamError) as err:  # no LM head: it never generates
        llm.generate("hello", SamplingParams(max_tokens=2))
    assert err.value.param == "model"
    assert llm.engine.kv_manager.pool.num_free == llm.engine.resolved.num_blocks


def test_a_yes_no_reranker_over_a_causal_lm_scores_p_yes(tmp_path, default_model_dir, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(6)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**BASE, "head_dim": 32, "tie_word_embeddings": False})).eval()
    path = _save(hf, tmp_path / "reranker", default_model_dir)
    scorer = {"classifier_from_token": ["no", "yes"], "template": TEMPLATE}
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, scorer=scorer)
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
    outs = llm.score([QUERY] * 3, DOCS)  # paired index by index
    for out, doc in zip(outs, DOCS):
        ids = tokenizer.encode(TEMPLATE.format(query=QUERY, document=doc), add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        assert out.score == pytest.approx(torch.softmax(last[[no, yes]], 0)[1].item(), abs=1e-5)
    # the same engine still generates
    assert llm.generate("hello", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ParamError) as err:
        llm.score([QUERY, QUERY], DOCS)
    assert err.value.param == "text_2"
    with pytest.raises(ParamError) as err:
        LLM(str(path), dtype="float32", scorer={"classifier_from_token": ["no", "definitely-not-one-token"]})
    assert err.value.param == "scorer.classifier_from_token"


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_yes_no_scores_on_a_gguf_read_its_rows_from_the_file(quantization, hf_default, tokenizer):
    """The embedded GGUF's conversion leaves its (tied) embedding in the file, dense weights
    or not: the yes/no rows come from the file's own tensor, and with the dense weights the
    scores are transformers' on the same values."""
    scorer = {"classifier_from_token": ["no", "yes"], "template": TEMPLATE}
    llm = LLM(None, dtype="float32", quantization=quantization, kv_cache_memory_bytes=8 << 20, scorer=scorer)
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
    outs = llm.score([QUERY] * 3, DOCS)
    for out, doc in zip(outs, DOCS):
        ids = tokenizer.encode(TEMPLATE.format(query=QUERY, document=doc), add_special_tokens=False)
        with torch.no_grad():
            last = hf_default(torch.tensor([ids])).logits[0, -1]
        want = torch.softmax(last[[no, yes]], 0)[1].item()
        assert out.score == pytest.approx(want, abs=1e-5 if quantization is None else 2e-2)
