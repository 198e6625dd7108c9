"""The engine client: AsyncLLM over an EngineCore in a thread or its own process, the
pipe's codec, and admission. Nothing here speaks HTTP or needs the serving stack: metrics
and traces are interfaces (observers.py) that engine/serving/ fills in. The core never
imports this package."""
