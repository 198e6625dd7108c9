"""The HTTP APIs over the engine client: the ASGI app and its plumbing (body parsing,
errors, middleware, tenancy, the preset, Prometheus metrics and OpenTelemetry traces) here;
one package per API (openai/, responses/); tool-call parsing (tools/) and reasoning
parsing beside them, shared by the APIs."""
