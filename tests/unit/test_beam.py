"""Beam search's parameters: what a beam search cannot honour is refused by name."""

from __future__ import annotations


import pytest

from engine import BeamSearchParams, SamplingParams
from engine.errors import ParamError


@pytest.mark.parametrize(("kw", "field"), [
    (dict(temperature=0.7), "temperature"),
    (dict(top_p=0.9), "top_p"),
    (dict(stop=["."]), "stop"),
    (dict(logprobs=2), "logprobs"),
    (dict(min_tokens=3), "min_tokens"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(length_penalty=float("nan")), "length_penalty"),
])
def test_what_beam_search_cannot_honour_is_refused_by_name(kw, field):
    with pytest.raises(ParamError) as err:
        SamplingParams(**{"n": 2, "temperature": 0.0, "use_beam_search": True, **kw}).validate()
    assert err.value.param == field
    with pytest.raises(ParamError) as err:
        SamplingParams(length_penalty=0.5).validate()
    assert err.value.param == "length_penalty"  # meaningless without beam search, so not ignored
    with pytest.raises(ParamError) as err:
        BeamSearchParams(0, 16).sampling_params()
    assert err.value.param == "beam_width"
