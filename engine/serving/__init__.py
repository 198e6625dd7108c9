"""The HTTP-facing layer over the engine core: AsyncLLM, the OpenAI protocol and handlers,
the ASGI app, error mapping, metrics and the serving preset. The core never imports it."""
