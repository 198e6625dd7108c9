"""`/v1/embeddings` in OpenAI's shape: a string, a list of strings, token ids or a list of
them; `encoding_format` float or base64 (little-endian float32, as OpenAI's SDK decodes
it); `dimensions` where the model was trained to be cut (engine/pooling.py). Each input
is an embedding request on the same engine, admission and tracing as generation."""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from engine.pooling import PoolingParams
from engine.serving.errors import bad_request
from engine.serving.openai.protocol import Priority, StrictModel, random_id
from engine.serving.openai.replies import UsageInfo

if TYPE_CHECKING:
    from engine.serving.openai.handlers import OpenAIServing


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # advisory, as OpenAI treats it
    priority: Priority = 0  # vLLM's: with scheduling_policy "priority", lower runs first


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    model: str
    data: list[Embedding]
    usage: UsageInfo


def inputs(given: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's inputs as a list, each non-empty."""
    if isinstance(given, str):
        items: list[str | list[int]] = [given]
    elif given and isinstance(given[0], int):
        items = [given]  # type: ignore[list-item]
    else:
        items = list(given)  # type: ignore[arg-type]
    if not items:
        raise bad_request("input must not be an empty list", "input")
    for i, item in enumerate(items):
        if len(item) == 0:
            raise bad_request(f"input[{i}] is empty: every input needs at least one token", "input")
    return items


def encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def embed(serving: OpenAIServing, req: EmbeddingRequest) -> EmbeddingResponse:
    serving.check_model(req.model)
    if serving.llm.info.embedding_size is None:
        raise bad_request(f"the model `{serving.model_name}` serves no embeddings: its preset sets no "
                          "engine.pooler and its checkpoint has no sentence-transformers pooling", "model",
                          "model_not_embedding")
    items = inputs(req.input)
    if len(items) > serving.max_sequences:
        raise bad_request(f"{len(items)} inputs; at most {serving.max_sequences} are accepted in one request",
                          "input")
    prompts = await serving.prompts_ids(items)
    rid = random_id("embd")
    vectors = await serving.pool(prompts, PoolingParams(dimensions=req.dimensions), rid, req.priority, "embeddings",
                                 {"prompt": "input"})
    count = sum(len(p) for p in prompts)
    data = [Embedding(index=i, embedding=encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(id=rid, model=serving.model_name, data=data,
                             usage=UsageInfo(prompt_tokens=count, total_tokens=count, completion_tokens=0))
