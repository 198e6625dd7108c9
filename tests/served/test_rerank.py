"""Score and rerank against the session's `bentoml serve`, whose preset asks the embedded
model a yes/no question about each (query, document) (tests/support/server.py): scores equal
transformers' P(yes) over the two tokens in fp32; /v1/rerank (Jina), /v2/rerank through the
`cohere` SDK's v2 client, unchanged, and /v1/score agree; and a LangChain RAG round trip
(embed, retrieve, rerank, answer) runs against the same server."""

from __future__ import annotations

import cohere
import pytest
import torch
import yaml

from tests.support.server import KEY, MODEL, PRESET

pytestmark = pytest.mark.timeout(600)

QUERY = "Which planet is the largest in the solar system?"
DOCS = ["Jupiter is the largest planet in our solar system.", "Water boils at 100 degrees Celsius at sea level.",
        "The train to Berlin departs from platform nine.", "Saturn has the most spectacular rings of any planet."]
TEMPLATE = yaml.safe_load(PRESET)["engine"]["scorer"]["template"]


def p_yes(hf, tokenizer, query: str, doc: str) -> float:
    ids = tokenizer.encode(TEMPLATE.format(query=query, document=doc), add_special_tokens=False)
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
    with torch.no_grad():
        last = hf(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(last[[no, yes]], 0)[1].item()


def test_rerank_and_score_equal_transformers_and_each_other(server, http, hf_default, tokenizer):
    want = [p_yes(hf_default, tokenizer, QUERY, d) for d in DOCS]
    r = http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [x["index"] for x in results] == order, (want, results)
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}

    co = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=180)
    ranked = co.rerank(model=MODEL, query=QUERY, documents=DOCS)  # POST /v2/rerank
    assert [x.index for x in ranked.results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [x.relevance_score for x in ranked.results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)

    pairs = http.post("/v1/score", json={"text_1": [QUERY] * 4, "text_2": DOCS}).json()
    one_to_many = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in pairs["data"]] == [d["score"] for d in one_to_many["data"]]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want, abs=1e-5)
    assert pairs["usage"]["prompt_tokens"] == sum(
        len(tokenizer.encode(TEMPLATE.format(query=QUERY, document=d), add_special_tokens=False)) for d in DOCS)
    assert http.get("/stats").json()["blocks_used"] == 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v2/rerank", {"query": "q", "documents": [{"txt": "d"}]}, "documents[0]"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
])
def test_bad_score_and_rerank_requests_are_400s_naming_the_field(http, path, body, param):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_a_langchain_rag_round_trip_embeds_retrieves_reranks_and_answers(server):
    """LangChain's OpenAI embeddings and chat model and the cohere SDK's rerank, all pointed
    at this one server: the retrieved documents are those nearest by our own vectors, the
    answer's prompt carries the document the reranker put first."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    base = f"{server.url}/v1"
    # check_embedding_ctx_length off: it would tokenize with tiktoken, OpenAI's own vocabulary
    embeddings = OpenAIEmbeddings(model=MODEL, base_url=base, api_key=KEY, check_embedding_ctx_length=False)
    store = InMemoryVectorStore.from_documents([Document(page_content=d) for d in DOCS], embeddings)
    hits = store.similarity_search(QUERY, k=3)
    vectors = embeddings.embed_documents(DOCS)
    q = torch.tensor(embeddings.embed_query(QUERY))
    nearest = sorted(range(len(DOCS)), key=lambda i: -float(q @ torch.tensor(vectors[i])))[:3]
    assert [h.page_content for h in hits] == [DOCS[i] for i in nearest]

    co = cohere.ClientV2(base_url=server.url, api_key=KEY, timeout=180)
    ranked = co.rerank(model=MODEL, query=QUERY, documents=[h.page_content for h in hits], top_n=1)
    best = hits[ranked.results[0].index].page_content
    llm = ChatOpenAI(model=MODEL, base_url=base, api_key=KEY, temperature=0, max_tokens=24)
    answer = llm.invoke([("system", f"Answer from this document: {best}"), ("user", QUERY)])
    assert answer.content.strip()
    assert answer.usage_metadata["input_tokens"] > len(best.split())
