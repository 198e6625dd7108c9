"""Structured outputs end to end, with the real openai client against `bentoml serve`:
JSON schemas through `chat.completions.parse`, regex and choice constraints on every
sample, bad constraints as 400s. The server is the session's (tests/support/server.py)."""

from __future__ import annotations

import concurrent.futures
import enum
import re
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.server import MODEL

pytestmark = pytest.mark.timeout(600)


class Size(str, enum.Enum):
    small = "small"
    medium = "medium"
    large = "large"


# Bounded, as a careful schema is: a 135M model left free loops on digits and words, and the
# grammar, which follows the schema, lets it (xgrammar honours these ranges and lengths).
class Address(BaseModel):
    city: str = Field(max_length=24)
    postcode: int = Field(ge=0, le=99999)


class Place(BaseModel):
    name: str = Field(max_length=32)
    size: Size
    rating: float = Field(ge=0, le=5)
    address: Address
    tags: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)


TOPICS = ["a bakery", "a museum", "a park", "a library", "a cafe", "a stadium", "a harbour", "a cinema",
          "a castle", "a train station"]


def test_parse_returns_a_valid_object_for_ten_prompts(client):
    def ask(topic: str):
        return client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
            response_format=Place, max_tokens=200, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, TOPICS))
    parsed = [a.choices[0].message.parsed for a in answers]
    assert all(isinstance(p, Place) for p in parsed), [a.choices[0].message.content for a in answers]
    assert all(a.choices[0].finish_reason == "stop" for a in answers)
    assert len({p.model_dump_json() for p in parsed}) > 1  # the prompt still matters


def test_regex_and_choice_hold_on_every_sample(client):
    r = client.completions.create(model=MODEL, prompt="A product code:", n=4, temperature=1.0, seed=3,
                                  max_tokens=20, extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    assert len(r.choices) == 4 and all(re.fullmatch(r"[A-Z]{2}-\d{3}", c.text) for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], n=4,
                                       temperature=1.0, seed=4, max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert all(c.message.content in ("yes", "no", "it depends") for c in r.choices)


def test_a_stream_keeps_to_the_schema(client):
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a lighthouse as JSON."}], stream=True,
        max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": Place.model_json_schema()}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Place.model_validate_json(text)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_bad_constraints_are_400s_and_the_server_carries_on(client, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    assert exc.value.body["param"] == param and exc.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
