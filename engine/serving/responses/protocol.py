"""The Responses API's request, response and stream-event models (`/v1/responses`).

Shaped as OpenAI documents them, so the `openai` SDK and the Agents SDK parse them
unchanged. Requests are strict like the chat ones (protocol.StrictModel): `null` is unset,
unknown fields follow service.unknown_fields, and input items or tools of a kind this
server cannot serve (images, files, web or file search, computer use, MCP, ...) are 400s
naming them rather than being dropped from the conversation.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from engine.serving.openai.protocol import StrictModel

ITEM_KINDS = "message, function_call, function_call_output and reasoning"


def item_id(prefix: str) -> str:
    """OpenAI's spelling: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request --------------------------------------------------------------------------
class InputText(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # echoed back from an earlier output
    logprobs: list[dict[str, Any]] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


def _type(v: Any) -> str:
    """A union member's tag: its `type`."""
    return v.get("type", "") if isinstance(v, dict) else getattr(v, "type", "")


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[InputText, Tag("output_text")]
    | Annotated[InputText, Tag("text")] | Annotated[Refusal, Tag("refusal")],
    Discriminator(_type, custom_error_type="unsupported_content",
                  custom_error_message="unsupported content part type; this server takes text parts "
                                       "(input_text, output_text) and refusals"),
]


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, InputText) else p.refusal for p in content)


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None  # an earlier output echoed back
    status: str | None = None

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _text(self.output)


class ReasoningItem(StrictModel):
    """An earlier output's reasoning, echoed back (the Agents SDK sends it): checked, and
    left out of the prompt, as chat templates leave out earlier turns' reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(v: Any) -> str:
    if isinstance(v, dict):
        return v.get("type", "message")  # an "easy" message has no type
    return getattr(v, "type", "")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="unsupported_item",
                  custom_error_message=f"unsupported input item type; this server takes {ITEM_KINDS} items"),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("function")],
    Discriminator(_type, custom_error_type="unsupported_tool",
                  custom_error_message="unsupported tool type; this server calls `function` tools only"),
]


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only level a model without that training has


class ReasoningConfig(StrictModel):
    effort: None = None  # this server's models have no reasoning effort to set; any value is a 400
    summary: Literal["auto", "concise", "detailed"] | None = None  # no reasoning items: nothing to summarize
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool | None = None  # not supported: true is a 400, never silently dropped
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # include_obfuscation: nothing to obfuscate here
    truncation: Literal["disabled"] | None = None  # "auto" would drop history; a prompt too long is a 400
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = None
    # advisory, as in chat
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


# -- response ----------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A <think> block, with service.reasoning_parser."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class Response(BaseModel):
    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    usage: ResponseUsage | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True

