"""The JSON checks every request body passes (engine/serving/jsontext.py): linear in time
and memory whatever the document's shape, and still naming where a bad value is."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from engine.serving import jsontext
from engine.serving.errors import APIError


def test_a_long_key_above_a_long_list_costs_memory_linear_in_the_body():
    """A path spelled for every node cost len(key) x len(list) bytes: 20,000 x 20,000 here
    would have peaked near 400 MB. The walk keeps links to parents instead."""
    doc = {"k" * 20_000: [0] * 20_000}
    tracemalloc.start()
    try:
        jsontext.check_values(doc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_the_path_is_named_only_where_a_value_is_bad():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "ok"},
                                                  {"role": "user", "content": "\ud800"}]})
    with pytest.raises(APIError) as err:
        jsontext.loads(body)
    assert err.value.detail.param == "messages[1].content"
    with pytest.raises(APIError) as err:
        jsontext.loads('{"a": {"b": [1, 2, 1e400]}}')
    assert err.value.detail.param == "a.b[2]"
    with pytest.raises(APIError) as err:
        jsontext.check_values({"x" * 100_000: [float("inf")]})
    assert len(err.value.detail.param) <= jsontext.MAX_PATH_CHARS + 3


def test_a_document_of_too_many_values_is_refused():
    with pytest.raises(APIError, match="more than"):
        jsontext.check_values([0] * (jsontext.MAX_NODES + 1))
    jsontext.check_values([0] * (jsontext.MAX_NODES - 1))
