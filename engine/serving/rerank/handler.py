"""Score and rerank: each (query, document) pair is a scoring request on the engine, all in
flight together, on the same admission, deadlines and tracing as generation."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine import scoring
from engine.pooling import PoolingParams
from engine.serving.errors import bad_request
from engine.serving.openai.protocol import random_id
from engine.serving.rerank.protocol import (
    RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse,
    ScoreUsage,
)

if TYPE_CHECKING:
    from engine.serving.openai.handlers import OpenAIServing


async def score(serving: OpenAIServing, req: ScoreRequest) -> ScoreResponse:
    rid = random_id("score")
    values, tokens = await _run(serving, req.model, scoring.pairs(req.text_1, req.text_2), rid, req.priority,
                                "text_2")
    return ScoreResponse(id=rid, created=int(time.time()), model=serving.model_name,
                         data=[ScoreData(index=i, score=v) for i, v in enumerate(values)],
                         usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))


async def rerank(serving: OpenAIServing, req: RerankRequest) -> RerankResponse:
    if not req.documents:
        raise bad_request("documents must not be empty", "documents")
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    scored = texts if req.max_tokens_per_doc is None else await _cut(serving, texts, req.max_tokens_per_doc)
    rid = random_id("rerank")
    values, tokens = await _run(serving, req.model, [(req.query, t) for t in scored], rid, req.priority, "documents")
    order = sorted(range(len(texts)), key=lambda i: -values[i])[: req.top_n or len(texts)]
    results = [RerankResult(index=i, relevance_score=values[i],
                            document=RerankDocument(text=texts[i]) if req.return_documents else None) for i in order]
    return RerankResponse(id=rid, model=serving.model_name, usage=RerankUsage(total_tokens=tokens), results=results)


async def _cut(serving: OpenAIServing, texts: list[str], limit: int) -> list[str]:
    """Each document cut to its first `limit` tokens, as Cohere's max_tokens_per_doc says."""
    tok = serving.tokenizer

    def cut() -> list[str]:
        out = []
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            out.append(text if len(ids) <= limit else tok.decode(ids[:limit]))
        return out

    return await serving.offload.run(sum(len(t) for t in texts), cut)


async def _run(serving: OpenAIServing, model: str | None, pairs: list[tuple[str, str]], rid: str, priority: int,
               field: str) -> tuple[list[float], int]:
    """Every pair's score (the head's one label) and the prompt tokens they took."""
    serving.check_model(model)
    info = serving.llm.info
    if not info.scores:
        raise bad_request(f"the model `{serving.model_name}` serves no scores: serve a sequence-classification "
                          "checkpoint, or set engine.scorer in its preset", "model", "model_not_scoring")
    if len(pairs) > serving.max_sequences:
        raise bad_request(f"{len(pairs)} pairs to score; at most {serving.max_sequences} are accepted in one "
                          "request", field)
    tok, template = serving.tokenizer, info.score_template
    size = sum(len(a) + len(b) for a, b in pairs)
    prompts = await serving.offload.run(size, lambda: [scoring.prompt_ids(tok, a, b, template) for a, b in pairs])
    results = await serving.pool(prompts, PoolingParams(task="score"), rid, priority, "score", {"prompt": field})
    labels = len(results[0])
    if labels != 1:
        raise bad_request(f"the model's scoring head has {labels} labels; score and rerank need one (LLM.score "
                          "returns every label's)", "model")
    return [r[0] for r in results], sum(len(p) for p in prompts)
