"""OpenTelemetry traces: one span per engine request, in the GenAI semantic conventions.

The span starts when AsyncLLM takes the request and ends with its last output, under
whatever context is current then: the HTTP layer makes an incoming `traceparent` current
(continue_trace), so the span joins the caller's trace. Nothing is exported unless
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (setup_from_env); without a provider the
API's no-op tracer makes every call here free.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context, propagate, trace


TRACER = "pagedserve"
# The HTTP request's X-Request-Id (engine/serving/middleware.py sets it), for logs and spans.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
# The routes that generate, for BentoML's `tracing.excluded_urls` (a regex searched in the
# request's URL). BentoML's OpenTelemetry middleware records a server span per request
# and one more span per ASGI message, even with sampling off: on a stream, a span per
# token. At c=64 those took about 40% of the HTTP worker's CPU per token (session 20),
# time taken from the engine's cores. The engine's own span (start_span) stands for the
# request and continues the caller's trace; every other route keeps BentoML's spans.
GENERATION_ROUTES = r"/(v1/completions|v1/chat/completions|v1/responses|v1/messages|v1/embeddings|v1/score|v1/rerank|v2/rerank|generate|chat)/?(\?|$)"


def setup_from_env(service_name: str = "pagedserve") -> bool:
    """Export spans over OTLP/HTTP when the endpoint variable is set; True if it was."""
    if not os.environ.get(ENDPOINT_ENV):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads the endpoint variable
    trace.set_tracer_provider(provider)
    return True


@contextlib.contextmanager
def continue_trace(headers: Mapping[str, str]) -> Iterator[None]:
    """Make the caller's trace (W3C traceparent/tracestate) current for this block, unless
    a span already is (BentoML's own HTTP span, which has continued it already)."""
    if trace.get_current_span().get_span_context().is_valid:
        yield
        return
    token = context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        context.detach(token)


def start_span(operation: str, model: str, request_id: str, params: Any, num_prompt_tokens: int) -> trace.Span:
    span = trace.get_tracer(TRACER).start_span(f"{operation} {model}", kind=trace.SpanKind.SERVER)
    if span.is_recording():
        span.set_attributes({
            "gen_ai.operation.name": operation, "gen_ai.system": "pagedserve", "gen_ai.request.model": model,
            "gen_ai.response.model": model, "gen_ai.response.id": request_id,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n, "gen_ai.usage.input_tokens": num_prompt_tokens,
        })
        if params.max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)
        if REQUEST_ID.get() is not None:
            span.set_attribute("http.request.header.x-request-id", [REQUEST_ID.get()])
    return span


def end_span(span: trace.Span, last: Any, error: BaseException | None = None) -> None:
    """`last`: the request's last StreamOutput (None if none came), whose counts are the core's."""
    if span.is_recording():
        span.set_attributes({"gen_ai.usage.output_tokens": last.num_output_tokens if last else 0,
                             "gen_ai.usage.cache_read.input_tokens": last.num_cached_tokens if last else 0,
                             "gen_ai.response.finish_reasons": (last.finish_reasons or []) if last else []})
        m = last.metrics if last else None
        if m is not None and m.first_scheduled_time is not None:
            span.set_attribute("gen_ai.latency.time_in_queue", m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", m.first_token_time - m.arrival_time)
                span.set_attribute("gen_ai.latency.time_in_model_prefill", m.first_token_time - m.first_scheduled_time)
                if m.finished_time is not None:
                    span.set_attribute("gen_ai.latency.time_in_model_decode", m.finished_time - m.first_token_time)
                    span.set_attribute("gen_ai.latency.e2e", m.finished_time - m.arrival_time)
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.StatusCode.ERROR, str(error))
    span.end()
