"""OpenAI-shaped request models, and the tokenizer routes' (the responses are replies.py's).

Field names, defaults and nesting follow OpenAI's API reference, so the official SDK
parses every response unchanged. Requests are checked as OpenAI documents them: types
strictly (`"max_tokens": "12"`, `"n": 2.0` and `"stream": "true"` are 400s, not quietly
coerced). An explicit `null` means "unset", as OpenAI's spec allows for every optional
field. A field we do not know is a 400 naming it, or (service.unknown_fields: warn, the
default) dropped with a warning that names it: see docs/service.md. The fields OpenAI
itself treats as advisory (`user`, `metadata`, `store`, `service_tier`, ...) are accepted,
as are the keys OpenAI's own responses carry when a client echoes a message back into
the history; fields that would change the output and cannot be honoured (audio output,
web search) are 400s naming them. Range checks
(temperature >= 0, ...) live in SamplingParams, the one place that knows them; the
serving layer maps its errors back to these field names. vLLM extensions (top_k,
min_p, repetition_penalty, ...) are accepted as OpenAI's SDK sends them through
`extra_body`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


# A request's priority (scheduling_policy "priority"): bounded so that it always crosses to
# the engine process as the 64-bit integer it is encoded as.
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StrictModel(BaseModel):
    """A request body as clients send it: strict types, no unknown keys (parsing.py decides
    whether an unknown one is a 400 or dropped), an explicit null as unset. The Responses
    and Anthropic routes' bodies use it too."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`"n": null` is the default n, as in OpenAI's spec (LangChain and LlamaIndex send them)."""
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None}
        return data


# -- errors ---------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- shared pieces --------------------------------------------------------------------
class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk, not only the last


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # What OpenAI's responses carry, echoed back in the history by clients: checked, not used
    # (reasoning_content goes to templates that render it, e.g. Qwen3's).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JSONSchemaFormat(StrictModel):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means no arguments
    strict: bool | None = None  # arguments always follow the schema when a call is forced


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(StrictModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(StrictModel):
    """Fields chat and completions share. None means the OpenAI default."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    # advisory in OpenAI's API: accepted, and they change nothing here
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # not with stream: the answer carries them once, whole
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, description="isolates this tenant's prefix-cache entries")
    priority: Priority = 0  # lower is served first, with the engine's scheduling_policy "priority"
    # beam search over n beams, all returned best first (vLLM's fields; early_stopping as transformers')
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: until the context is full, as OpenAI
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    # Known, and refused when they ask for what this server cannot give (handlers check them).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# -- tokenizer routes -----------------------------------------------------------------
class TokenizeRequest(StrictModel):
    """Either a prompt or chat messages (rendered with the chat template), as vLLM's /tokenize."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered into the prompt as chat requests render them
    chat_template_kwargs: dict[str, Any] | None = None  # as a chat request's
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
