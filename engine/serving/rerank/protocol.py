"""Request and response bodies of the score and rerank routes, as vLLM answers them (its
rerank body is Jina's, which Cohere's v2 clients also read: results by index, each with a
relevance_score and, unless declined, the document)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from engine.serving.openai.protocol import Priority, StrictModel


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: Priority = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class TextDocument(StrictModel):
    text: str


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str | TextDocument]  # Cohere's v1 also sends {"text": ...} objects
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    max_tokens_per_doc: int | None = Field(None, ge=1)  # Cohere v2's: longer documents are cut to this
    priority: Priority = 0


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
