"""The OpenAI API over AsyncLLM: requests to SamplingParams, engine deltas to responses.

Nothing here knows about HTTP frameworks: it takes validated protocol models and returns
protocol models or an async iterator of Server-Sent Event strings, and raises APIError
with the status and OpenAI error fields to send. engine/serving/app.py does the HTTP.
This file holds the intake every route shares and chat; completions.py and logprobs.py
the rest.

A streamed request is primed before it is returned: its first delta is awaited here,
so a request the engine rejects (a prompt longer than max_model_len, say) is a clean
400 rather than a 200 whose stream breaks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.client.admission import Offload
from engine.client.async_llm import AsyncLLM, StreamOutput
from engine.pooling import PoolingParams
from engine.prompts import apply_chat_template, encode_prompt
from engine.sampling_params import Constraint, SamplingParams
from engine.serving import tenancy
from engine.serving.errors import APIError, bad_request, to_api_error
from engine.serving.openai.constraints import structured_output, token_keys
from engine.serving.openai.logprobs import LogprobFormatter
from engine.serving.openai.protocol import (
    ChatCompletionRequest, ChatMessage, DetokenizeRequest, SamplingFields, TokenizeRequest, Tool, ToolCall, random_id,
)
from engine.serving.openai.replies import (
    ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice, DeltaFunctionCall,
    DeltaMessage, DeltaToolCall, DetokenizeResponse, ModelCard, ModelList, TokenizeResponse, UsageInfo,
)
from engine.serving.openai.streams import DONE, Choice, Started, absorb, chain, collect, sse, usage
from engine.serving.reasoning import ReasoningParserName
from engine.serving.responses.store import ResponseStore
from engine.serving.tools import calls as tools_mod


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, root: str | None = None,
                 aliases: Sequence[str] = (), store: ResponseStore | None = None,
                 reasoning_parser: ReasoningParserName | None = None, tool_call_parser: str | None = None,
                 max_sequences_per_request: int = 256, cache_scope: tenancy.PrefixCacheScope = "per_key") -> None:
        """`aliases`: other names clients may send as `model` (the Hugging Face id, say);
        responses always name the model by served_model_name. `store` keeps the
        Responses API's stored responses (engine/serving/responses/handler.py);
        `reasoning_parser` splits a <think> block from the answer (reasoning.py);
        `tool_call_parser` is the calls' format, by default the one the chat template teaches;
        `max_sequences_per_request` bounds prompts x n; `cache_scope` says whether API keys
        share prefix-cache blocks (engine/serving/tenancy.py)."""
        self.max_sequences = max_sequences_per_request
        self.cache_scope = cache_scope
        self.store = store if store is not None else ResponseStore()
        self.reasoning_parser = reasoning_parser
        self.llm = llm
        self.model_name = served_model_name
        self.names = list(dict.fromkeys([served_model_name, *aliases]))
        self.root = root
        self.created = int(time.time())
        self._tok = llm.tokenizer
        self._native_tools = tools_mod.template_takes_tools(self._tok)
        self.tool_format = tool_call_parser or tools_mod.template_format(self._tok)
        self._special_marker = tools_mod.marker_is_special(self._tok, self.tool_format)
        self.offload = Offload()
        self.logprobs = LogprobFormatter(self._tok)

    @property
    def tokenizer(self) -> Any:
        return self._tok

    # -- simple routes --------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "invalid_request_error", "model", "model_not_found")

    def models(self) -> ModelList:
        info = self.llm.info
        return ModelList(data=[ModelCard(id=name, created=self.created, root=self.root,
                                         max_model_len=info.max_model_len, quantization=info.stats.quantization)
                               for name in self.names])

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
        if req.messages is not None:
            ids = await self.chat_prompt_async(req.messages, req.add_generation_prompt, req.tools,
                                               req.chat_template_kwargs)
        else:
            ids = await self.offload.run(len(req.prompt), functools.partial(
                self._tok.encode, req.prompt, add_special_tokens=req.add_special_tokens))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.llm.info.max_model_len)

    async def chat_prompt_async(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                                tools: list[Tool] | None = None,
                                template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """chat_prompt, off the event loop when what the template renders is large: every
        part of every message (tool-call arguments and reasoning too, not the text alone),
        the tools and the template's variables."""
        size = (sum(len(m.model_dump_json()) for m in messages) + sum(len(t.model_dump_json()) for t in tools or [])
                + len(json.dumps(template_kwargs or {})))
        return await self.offload.run(size, self.chat_prompt, messages, add_generation_prompt, tools,
                                      template_kwargs)

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids, tokenized off the loop when the text is large."""
        if not isinstance(prompt, str):
            return prompt
        return await self.offload.run(len(prompt), encode_prompt, self._tok, prompt)

    async def prompts_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Every prompt's ids, off the loop in one piece when their text is large together:
        a thousand short prompts are as much work as one long one."""
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return await self.offload.run(size, lambda: [p if not isinstance(p, str) else encode_prompt(self._tok, p)
                                                     for p in prompts])

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = len(self._tok)
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        # a token is a few characters: size the work as text, as the tokenizing routes do
        text = await self.offload.run(4 * len(req.tokens), self._tok.decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[Tool] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if getattr(self._tok, "chat_template", None) is None:
            raise bad_request("this model has no chat template; send a prompt to /v1/completions", "messages")
        conv, specs = tools_mod.render(messages, tools or [], self._native_tools, self.tool_format)
        try:
            return apply_chat_template(self._tok, conv, add_generation_prompt, specs, template_kwargs)
        except ValueError as exc:
            raise to_api_error(exc) from None
        except Exception as exc:  # noqa: BLE001 - jinja raises its own types for bad conversations
            raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None

    # -- sampling -------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        names: dict[str, str], tool_call: Constraint | None = None,
                        prompt_logprobs: int | None = None, keep_special_tokens: bool = False) -> SamplingParams:
        """The model's generation_config.json, then OpenAI's defaults, where the request is
        silent (as vLLM's `--generation-config auto`); AsyncLLM.generate validates them, and
        `start` reports what it finds under the request's own field names.
        `keep_special_tokens` decodes them (keeps_special_tokens says when)."""
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs cannot be streamed; ask without stream", "prompt_logprobs")
        kw: dict[str, Any] = {
            "prompt_logprobs": req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            "bad_words": list(req.bad_words or []),
            "n": req.n, "max_tokens": max_tokens, "seed": req.seed, "logprobs": logprobs,
            "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            "stop_token_ids": list(req.stop_token_ids or []), "min_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens and not keep_special_tokens,
            "logit_bias": token_keys(req.logit_bias or {}, "logit_bias", self.llm.info.vocab_size),
            "allowed_token_ids": req.allowed_token_ids,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "structured": structured_output(req, names, tool_call),
            "use_beam_search": req.use_beam_search, "length_penalty": req.length_penalty,
            "early_stopping": req.early_stopping,
        }
        for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                            ("min_p", req.min_p), ("repetition_penalty", req.repetition_penalty),
                            ("presence_penalty", req.presence_penalty),
                            ("frequency_penalty", req.frequency_penalty)):
            if value is not None:
                kw[name] = value
            elif req.use_beam_search:  # the model's sampling defaults are for sampling, not beams
                if name == "temperature":
                    kw[name] = 0.0
            elif name in self.llm.info.sampling_defaults:
                kw[name] = self.llm.info.sampling_defaults[name]
        return SamplingParams(**kw)

    async def start(self, prompts: list[str | list[int]], params: SamplingParams, base_id: str,
                     req: SamplingFields, names: dict[str, str], operation: str = "text_completion"
                     ) -> list[Started]:
        """Submit every prompt and await each one's first delta; all or nothing."""
        self.store.sweep()  # expired stored responses go with any traffic, not only their own
        salt = tenancy.cache_salt(req.cache_salt, self.cache_scope)
        gens = [self.llm.generate(p, params, f"{base_id}-{i}", salt, operation, self.model_name,
                                  req.priority) for i, p in enumerate(prompts)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        err = next((f for f in firsts if isinstance(f, BaseException)), None)
        if err is not None:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
            raise to_api_error(err, names) from None
        return list(zip(firsts, gens, strict=True))  # type: ignore[arg-type]

    async def pool(self, prompts: list[list[int]], params: PoolingParams, base_id: str, priority: int,
                   operation: str, names: dict[str, str]) -> list[list[float]]:
        """Every prompt's pooled result (an embedding or a scoring head's scores), all in
        flight together; the first failure is raised as the client's error."""
        salt = tenancy.cache_salt(None, self.cache_scope)

        async def one(i: int, ids: list[int]) -> list[float]:
            last = None
            async for out in self.llm.generate(ids, None, f"{base_id}-{i}", salt, operation, self.model_name,
                                               priority, params):
                last = out
            if last is None or last.pooled is None:  # aborted: the server is going away
                raise APIError(503, "the request was aborted before it finished", "server_error")
            return last.pooled

        results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)), return_exceptions=True)
        err = next((r for r in results if isinstance(r, BaseException)), None)
        if err is not None:
            raise to_api_error(err, names) from None
        return results  # type: ignore[return-value]

    # -- chat -----------------------------------------------------------------------
    async def start_chat(self, req: ChatCompletionRequest, names: dict[str, str] | None = None
                         ) -> tuple[str, Started, list[Tool]]:
        """Render, check and submit a chat request: its id, its primed stream and the tools
        the model may call. `names` maps engine fields to the client's (the Responses API's)."""
        self.check_model(req.model)
        _refuse_unservable(req)
        tools = tools_mod.active_tools(req.tools, req.tool_choice)
        prompt = await self.chat_prompt_async(req.messages, req.add_generation_prompt, tools,
                                              req.chat_template_kwargs)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if req.logprobs and req.use_beam_search:
            raise bad_request("logprobs cannot be combined with use_beam_search", "logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if names is None:
            names = {"prompt": "messages", "logprobs": "top_logprobs"}
            if req.max_completion_tokens is not None:
                names["max_tokens"] = "max_completion_tokens"
        forced = tools_mod.constraint(tools, req.tool_choice, req.parallel_tool_calls, self.tool_format, req.tools)
        params = self.sampling_params(req, max_tokens, logprobs, names, forced,
                                      keep_special_tokens=self.keeps_special_tokens(req, tools))
        rid = random_id("chatcmpl")
        [started] = await self.start([prompt], params, rid, req, names, "chat")
        return rid, started, tools

    def keeps_special_tokens(self, req: ChatCompletionRequest, tools: list[Tool]) -> bool:
        """Whether this chat decodes special tokens although the request left
        skip_special_tokens unset: with tools to call in a format whose tag is a special
        token, the tag must reach the call parser (vLLM's tool parsers ask the same)."""
        return bool(tools) and self._special_marker and "skip_special_tokens" not in req.model_fields_set

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        rid, (first, gen), tools = await self.start_chat(req)
        if req.stream:
            return self._chat_stream(rid, first, gen, req.n, req.include_usage, req.continuous_usage, tools)
        choices = [Choice() for _ in range(req.n)]
        last = await collect([(first, gen)], choices, 0, req.n)
        return ChatCompletionResponse(
            id=rid, model=self.model_name, usage=usage([last]),
            choices=[self._chat_choice(i, c, tools, req.logprobs) for i, c in enumerate(choices)],
            prompt_logprobs=self.logprobs.prompt(last))

    def split(self, text: str, tools: list[Tool]) -> tuple[str | None, str, list[ToolCall]]:
        """A whole output's reasoning, content and tool calls: calls come from the content
        alone, never from inside a think block."""
        reasoning, text, calls = self.splitter(tools).whole(text)
        return reasoning or None, text, calls

    def splitter(self, tools: list[Tool], stream: bool = False) -> tools_mod.Splitter:
        """A choice's splitter into reasoning, content and calls, under this server's
        parsers; `stream` sends calls' arguments as they are generated."""
        return tools_mod.Splitter(tools, self.tool_format, self.reasoning_parser, stream)

    def _chat_choice(self, index: int, c: Choice, tools: list[Tool], want_logprobs: bool) -> ChatChoice:
        reasoning, text, calls = self.split(c.text, tools)
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return ChatChoice(index=index, message=ChatResponseMessage(content=text or None if calls else text,
                                                                   reasoning_content=reasoning, tool_calls=calls),
                          logprobs=self.logprobs.chat(c.logprobs) if want_logprobs else None,
                          finish_reason=finish, stop_reason=c.stop_reason)

    async def _chat_stream(self, rid: str, first: StreamOutput, gen: AsyncIterator[StreamOutput], n: int,
                           include_usage: bool, continuous_usage: bool, tools: list[Tool]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        splitters = [self.splitter(tools, stream=True) for _ in range(n)]
        try:
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(n)])
            choices = [Choice() for _ in range(n)]
            async for out in chain(first, gen):
                for d in out.deltas:
                    absorb(choices[d.index], d)
                    lp = self.logprobs.chat(d.logprobs) if d.logprobs is not None else None
                    delta, finish = _delta(splitters[d.index], d.text, d.finish_reason)
                    if splitters[d.index].holds and not (delta.content or delta.reasoning_content
                                                         or delta.tool_calls or finish or lp):
                        continue  # text held back while a tag is undecided
                    yield chunk([ChatStreamChoice(index=d.index, delta=delta, logprobs=lp, finish_reason=finish,
                                                  stop_reason=d.stop_reason)],
                                usage([out]) if continuous_usage else None)
            if include_usage:
                yield chunk([], usage([out]))
            yield DONE
        finally:
            await gen.aclose()  # type: ignore[attr-defined]


def _refuse_unservable(req: ChatCompletionRequest) -> None:
    """Fields that would change the answer if honoured, and that this server cannot honour."""
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise bad_request("this server answers in text only; modalities may only be [\"text\"]", "modalities")
    for name in ("audio", "web_search_options"):
        if getattr(req, name) is not None:
            raise bad_request(f"`{name}` is not supported by this server", name)
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise bad_request(f"the legacy `{name}` field is not supported; send `tools` and `tool_choice`", name)


def _delta(splitter: tools_mod.Splitter, text: str, finish: str | None) -> tuple[DeltaMessage, str | None]:
    """One streamed piece through the choice's splitter: shown reasoning and content,
    the calls' parts settled now, and the finish reason (tool_calls when the choice called any)."""
    reasoning, content, calls = splitter.feed(text, final=finish is not None)
    if splitter.num_calls and finish == "stop":
        finish = "tool_calls"
    deltas = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                            function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
              for c in calls if c.id or c.arguments]
    return DeltaMessage(content=content if not splitter.holds else content or None,
                        reasoning_content=reasoning or None, tool_calls=deltas or None), finish
