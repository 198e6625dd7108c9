"""The OpenAPI 3.1 document of the OpenAI routes, built from the protocol models.

Request bodies use the models' validation schemas (strict, no unknown fields), responses
their serialization schemas, and every documented error status OpenAI's error object, so
a client generator, a gateway or a fuzzer (tests/served/test_openapi.py runs schemathesis)
sees exactly what the server accepts and answers.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from engine.serving.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, TokenizeRequest,
)
from engine.serving.openai.replies import (
    ChatCompletionResponse, CompletionResponse, DetokenizeResponse, ModelCard, ModelList, TokenizeResponse,
)
from engine.serving.anthropic.protocol import (
    CountTokensRequest, ErrorBody, MessagesRequest, MessagesResponse, TokenCount,
)
from engine.serving.openai.embeddings import EmbeddingRequest, EmbeddingResponse
from engine.serving.rerank.protocol import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from engine.serving.responses.protocol import Response, ResponseDeleted, ResponsesRequest

ERRORS = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
          "408": "past the request's deadline", "413": "body too large", "429": "waiting queue full",
          "503": "engine down or shutting down"}
POSTS: list[tuple[str, str, type[BaseModel], type[BaseModel], bool]] = [
    ("/v1/chat/completions", "Create a chat completion", ChatCompletionRequest, ChatCompletionResponse, True),
    ("/v1/completions", "Create a completion", CompletionRequest, CompletionResponse, True),
    ("/v1/embeddings", "Create embeddings (models with a pooler)", EmbeddingRequest, EmbeddingResponse, False),
    ("/v1/score", "Relevance of text pairs (models with a scoring head)", ScoreRequest, ScoreResponse, False),
    ("/v1/rerank", "Rerank documents for a query (Jina's shape)", RerankRequest, RerankResponse, False),
    ("/v2/rerank", "Rerank documents for a query (Cohere's v2 path)", RerankRequest, RerankResponse, False),
    ("/tokenize", "Token ids of a prompt or of chat messages", TokenizeRequest, TokenizeResponse, False),
    ("/detokenize", "Text of token ids", DetokenizeRequest, DetokenizeResponse, False),
    ("/v1/responses", "Create a response (OpenAI's Responses API)", ResponsesRequest, Response, True),
]
ANTHROPIC_POSTS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/messages": (MessagesRequest, MessagesResponse),
    "/v1/messages/count_tokens": (CountTokensRequest, TokenCount),
}


def openapi_document(version: str = "1") -> dict[str, Any]:
    models: list[tuple[type[BaseModel], Any]] = []
    for _, _, req, resp, _ in POSTS:
        models += [(req, "validation"), (resp, "serialization")]
    models += [(ErrorResponse, "serialization"), (ModelList, "serialization"), (ModelCard, "serialization"),
               (ResponseDeleted, "serialization")]
    for req, resp in ANTHROPIC_POSTS.values():
        models += [(req, "validation"), (resp, "serialization")]
    models.append((ErrorBody, "serialization"))
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")

    def ref(model: type[BaseModel], mode: str = "serialization") -> dict[str, Any]:
        return refs[(model, mode)]

    def answers(ok: dict[str, Any], codes: tuple[str, ...], error: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
        out = {"200": {"description": "OK", "content": ok}}
        out.update({c: {"description": ERRORS[c], "content": {"application/json": {"schema": ref(error)}}}
                    for c in codes})
        return out

    paths: dict[str, Any] = {}
    for path, summary, req, resp, streams in POSTS:
        ok = {"application/json": {"schema": ref(resp)}}
        if streams:  # with "stream": true, Server-Sent Events: each data is a chunk object's JSON, or [DONE]
            ok["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
                "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}
        codes = ("400", "401", "404", "408", "413", "429", "503") if streams else ("400", "404", "408", "413", "503")
        paths[path] = {"post": {
            "summary": summary, "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req, "validation")}}},
            "responses": answers(ok, codes),
            **({"security": [{"bearer": []}]} if path.startswith("/v1/") else {}),
        }}
    for path, (req, resp) in ANTHROPIC_POSTS.items():
        ok = {"application/json": {"schema": ref(resp)}}
        if resp is MessagesResponse:  # with "stream": true, Anthropic's named events
            ok["text/event-stream"] = {"schema": {"type": "object", "required": ["event", "data"], "properties": {
                "data": {"type": "string"}, "event": {"type": "string"}}}}
        paths[path] = {"post": {
            "summary": f"Anthropic Messages API: {path}", "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req, "validation")}}},
            "responses": answers(ok, ("400", "401", "404", "408", "413", "429", "503"), ErrorBody),
            "security": [{"bearer": []}, {"apiKey": []}],
        }}
    paths["/v1/models"] = {"get": {"summary": "The served model and its aliases", "operationId": "list_models",
                                   "security": [{"bearer": []}],
                                   "responses": answers({"application/json": {"schema": ref(ModelList)}}, ("401",))}}
    paths["/v1/models/{model}"] = {"get": {
        "summary": "One model", "operationId": "retrieve_model", "security": [{"bearer": []}],
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": answers({"application/json": {"schema": ref(ModelCard)}}, ("401", "404"))}}
    stored = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths["/v1/responses/{response_id}"] = {
        "get": {"summary": "A stored response", "operationId": "retrieve_response", "security": [{"bearer": []}],
                "parameters": stored,
                "responses": answers({"application/json": {"schema": ref(Response)}}, ("401", "404"))},
        "delete": {"summary": "Delete a stored response", "operationId": "delete_response",
                   "security": [{"bearer": []}], "parameters": stored,
                   "responses": answers({"application/json": {"schema": ref(ResponseDeleted)}}, ("401", "404"))}}
    paths["/version"] = {"get": {"summary": "The server's version", "operationId": "version", "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": {
            "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve: OpenAI- and Anthropic-compatible API", "version": version},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    }


class MergedDocs:
    """BentoML's Swagger page at / lists only its own API methods (it merges mounted
    FastAPI apps, not Starlette ones): this puts the OpenAI routes into the document it
    reads (/docs.json), so the page shows every route the server answers."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.document = openapi_document()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != "/docs.json":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        body = b"".join(chunks)
        if start.get("status") == 200:
            spec = json.loads(body)
            spec["openapi"] = "3.1.0"  # the OpenAI routes' schemas are JSON Schema 2020-12, as 3.1 has it
            spec.setdefault("paths", {}).update(self.document["paths"])
            components = spec.setdefault("components", {})
            for key, values in self.document["components"].items():
                components.setdefault(key, {}).update(values)
            body = json.dumps(spec).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
