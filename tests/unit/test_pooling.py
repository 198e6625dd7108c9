"""Pooling and scoring settings (engine/pooling.py, engine/scoring.py): what a request may
ask, what a checkpoint's sentence-transformers files say, and errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ParamError
from engine.pooling import PoolerConfig, PoolingParams, check, finish, from_checkpoint
from engine.scoring import ScorerConfig, prompt_ids, scores


@pytest.mark.parametrize("params, field", [
    (PoolingParams(dimensions=0), "dimensions"),
    (PoolingParams(dimensions=True), "dimensions"),  # a bool is no integer here
    (PoolingParams(dimensions=1 << 40), "dimensions"),  # would not cross to the engine process
    (PoolingParams(normalize=1), "normalize"),
    (PoolingParams(task="classify"), "task"),
])
def test_bad_pooling_params_name_their_field(params, field):
    with pytest.raises(ParamError) as err:
        params.validate()
    assert err.value.param == field


def test_dimensions_are_checked_against_what_the_model_was_trained_for():
    fixed = PoolerConfig(pooling_type="last")
    check(PoolingParams(dimensions=64), fixed, 64)  # its own size is always fine
    for pooler, dims in ((fixed, 16), (PoolerConfig(pooling_type="last", matryoshka=True), 65),
                         (PoolerConfig(pooling_type="last", matryoshka=[16, 32]), 24)):
        with pytest.raises(ParamError) as err:
            check(PoolingParams(dimensions=dims), pooler, 64)
        assert err.value.param == "dimensions"
    check(PoolingParams(dimensions=32), PoolerConfig(pooling_type="last", matryoshka=[16, 32]), 64)


def test_a_cut_vector_is_normalized_again_unless_asked_not_to():
    v = torch.tensor([3.0, 4.0, 12.0])
    pooler = PoolerConfig(pooling_type="mean")
    assert finish(v, PoolingParams(dimensions=2), pooler) == pytest.approx([0.6, 0.8])
    assert finish(v, PoolingParams(dimensions=2, normalize=False), pooler) == [3.0, 4.0]
    assert finish(v, PoolingParams(), PoolerConfig(pooling_type="mean", normalize=False)) == [3.0, 4.0, 12.0]


def _sentence_transformers(path, pooling: dict, normalize: bool):
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_a_sentence_transformers_checkpoint_says_how_it_pools(tmp_path):
    class Config:
        matryoshka_dimensions = [32, 64]

    assert from_checkpoint(tmp_path, Config()) is None  # not a sentence-transformers directory
    _sentence_transformers(tmp_path, {"pooling_mode_lasttoken": True}, normalize=True)
    assert from_checkpoint(tmp_path, Config()) == PoolerConfig(pooling_type="last", normalize=True,
                                                                matryoshka=[32, 64])
    _sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    assert from_checkpoint(tmp_path, object()) == PoolerConfig(pooling_type="mean", normalize=False)
    _sentence_transformers(tmp_path, {"pooling_mode_cls_token": True}, normalize=False)
    with pytest.raises(ParamError) as err:
        from_checkpoint(tmp_path, object())
    assert err.value.param == "pooler" and "pooling_mode_cls_token" in str(err.value)
    (tmp_path / "modules.json").write_text("[{")
    with pytest.raises(ParamError) as err:
        from_checkpoint(tmp_path, object())
    assert err.value.param == "pooler"


def test_scores_and_the_scored_prompt(tokenizer):
    with pytest.raises(ParamError) as err:
        EngineConfig.create(scorer={"template": "{query} only"})
    assert err.value.param == "scorer.template"
    assert EngineConfig.create(scorer={"classifier_from_token": ["no", "yes"]}).scorer == ScorerConfig(
        classifier_from_token=("no", "yes"))
    assert scores(torch.tensor([[1.0, 0.0]]), torch.tensor([0.0, 5.0])) == [0.5]
    assert scores(torch.tensor([[0.0], [1.0]]), torch.tensor([2.0])) == pytest.approx(
        torch.softmax(torch.tensor([0.0, 2.0]), 0).tolist())
    assert prompt_ids(tokenizer, "q", "d", "Q: {query} D: {document}") == tokenizer.encode(
        "Q: q D: d", add_special_tokens=False)
    assert prompt_ids(tokenizer, "q", "d", None) == tokenizer("q", text_pair="d")["input_ids"]
