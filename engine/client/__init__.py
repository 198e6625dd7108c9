"""The engine client: AsyncLLM over an EngineCore in a thread or its own process, the
pipe's codec, admission, and the metrics and traces of each request. Nothing here speaks
HTTP; engine/serving/ builds the APIs on top, and the core never imports either."""
