"""`/v1/embeddings` with the official `openai` SDK against the session's `bentoml serve`,
whose preset pools the embedded model's last hidden states by mean (tests/support/server.py):
vectors equal transformers' pooled hidden states in fp32, in both encodings; embedding
requests interleaved with 32 streaming chats leave no KV block in use; bad input is a 400
in OpenAI's shape naming the field."""

from __future__ import annotations

import asyncio
import base64
import struct

import httpx
import pytest
import torch
import torch.nn.functional as F

from tests.support.server import KEY, MODEL

pytestmark = pytest.mark.timeout(600)

TEXTS = ["Paris is the capital of France.", "Paged attention stores the KV cache in blocks.",
         "def add(a, b):\n    return a + b\n"]


def reference(hf, tokenizer, text: str | list[int]) -> torch.Tensor:
    ids = tokenizer(text)["input_ids"] if isinstance(text, str) else text
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden.mean(0), dim=0)


def assert_close(got: list[float], ref: torch.Tensor) -> None:
    vec = torch.tensor(got)
    assert vec.shape == ref.shape
    assert F.cosine_similarity(vec, ref, dim=0).item() > 1 - 1e-5
    torch.testing.assert_close(vec, ref, rtol=1e-4, atol=1e-5)


def test_the_sdk_gets_transformers_pooled_vectors_in_both_encodings(client, http, hf_default, tokenizer):
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    for d, text in zip(r.data, TEXTS):
        assert_close(d.embedding, reference(hf_default, tokenizer, text))
    ids = tokenizer(TEXTS[1])["input_ids"]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)

    plain = http.post("/v1/embeddings", json={"model": MODEL, "input": [ids, ids[:3]], "encoding_format": "float"})
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["embedding"] * 2
    assert_close(body["data"][0]["embedding"], reference(hf_default, tokenizer, ids))
    assert_close(body["data"][1]["embedding"], reference(hf_default, tokenizer, ids[:3]))
    packed = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(body["data"][0]["embedding"], abs=1e-6)


def test_embeddings_interleaved_with_32_streaming_chats_leave_no_block_in_use(server, http, hf_default, tokenizer):
    async def chat(c: httpx.AsyncClient, i: int) -> str | None:
        body = {"model": MODEL, "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 10}."}]}
        finish = None
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"finish_reason":"' in line.replace(" ", ""):
                    finish = "seen"
        return finish

    async def embed(c: httpx.AsyncClient, text: str) -> list[float]:
        await asyncio.sleep(0.05)
        r = await c.post("/v1/embeddings", json={"input": text, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=180) as c:
            chats = [asyncio.create_task(chat(c, i)) for i in range(32)]
            vectors = await asyncio.gather(*(embed(c, t) for t in TEXTS * 2))
            return await asyncio.gather(*chats), vectors

    finishes, vectors = asyncio.run(run())
    assert finishes == ["seen"] * 32
    for vec, text in zip(vectors, TEXTS * 2):
        assert_close(vec, reference(hf_default, tokenizer, text))
    assert http.get("/stats").json()["blocks_used"] == 0


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [5, 10**9]}, "input"),
    ({"input": "x", "dimensions": 16}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 10**30}, "dimensions"),
    ({"input": "x", "priority": 10**30}, "priority"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": {"text": "x"}}, "input"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert http.get("/stats").json()["blocks_used"] == 0


def test_an_unknown_model_is_a_404(http):
    r = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
