"""Relevance scores: vLLM's /v1/score, and rerank in Jina's and Cohere's shape (/v1/rerank,
/v2/rerank), over the engine's scoring head (engine/scoring.py)."""
