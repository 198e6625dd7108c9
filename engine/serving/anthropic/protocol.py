"""The Anthropic Messages API's request and response bodies, as its reference defines them.

Requests are checked as strictly as the OpenAI routes' (protocol.py of openai/): types
are not coerced, an explicit null is unset, and a content block of a type we do not know
is a 400 naming where it is. Blocks the engine cannot take (images and documents while no
vision model is served) parse here and are refused by name in handler.py, so that the
error says what was sent rather than that it matched no type.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from engine.serving.openai.protocol import StrictModel


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# -- request content blocks ------------------------------------------------------------
class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (the prefix cache)
    citations: list[dict[str, Any]] | None = None


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(StrictModel):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock, Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


# -- tools -----------------------------------------------------------------------------
class ToolDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # Anthropic's own rule for tool names
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the one tool to call
    disable_parallel_tool_use: bool | None = None


class Thinking(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class MessagesRequest(StrictModel):
    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Older SDKs and raw clients send these; the current SDK sends them through extra_body.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None  # advisory (user_id), as on Anthropic's side
    service_tier: str | None = None  # advisory: one tier here


class CountTokensRequest(StrictModel):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# -- responses -------------------------------------------------------------------------
class OutText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutThinking(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing to verify: the thinking is the model's own text, unredacted


class OutToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutBlock = OutText | OutThinking | OutToolUse


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens the prefix cache held
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str = Field(default_factory=message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutBlock] = Field(default_factory=list)
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: Usage = Field(default_factory=Usage)


class TokenCount(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    """Every error on these routes (errors.anthropic_body builds it)."""

    type: Literal["error"] = "error"
    error: ErrorDetail
