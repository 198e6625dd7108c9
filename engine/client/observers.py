"""What AsyncLLM reports, as interfaces: the serving layer plugs in Prometheus metrics
(engine/serving/metrics.py) and OpenTelemetry spans (engine/serving/tracing.py), so that
the engine client itself needs neither library, and a client built without them simply
reports nothing."""

from __future__ import annotations

from typing import Any, Protocol

from engine.messages import StepOutput
from engine.stats import EngineStats


class StepObserver(Protocol):
    """Told the engine's facts at start, then every step's output, on the engine thread."""

    def record_start(self, stats: EngineStats, block_size: int, cache_dtype: str, prefix_caching: bool) -> None: ...

    def record_step(self, step: StepOutput) -> None: ...


class RequestTracer(Protocol):
    """One span per request: opened when AsyncLLM takes it, closed with its last output
    (None if none came) and the error that ended it, if any."""

    def start_span(self, operation: str, model: str, request_id: str, params: Any,
                   num_prompt_tokens: int) -> Any: ...

    def end_span(self, span: Any, last: Any, error: BaseException | None = None) -> None: ...
