"""The OpenAI API over AsyncLLM: requests to SamplingParams, engine deltas to responses.

Nothing here knows about HTTP frameworks: it takes validated protocol models and returns
protocol models or an async iterator of Server-Sent Event strings, and raises APIError
with the status and OpenAI error fields to send. engine/serving/app.py does the HTTP.

A streamed request is primed before it is returned: its first delta is awaited here,
so a request the engine rejects (a prompt longer than max_model_len, say) is a clean
400 rather than a 200 whose stream breaks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.llm import apply_chat_template
from engine.outputs import CompletionDelta
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.serving.async_llm import AsyncLLM, StreamOutput
from engine.serving.errors import APIError, bad_request, to_api_error
from engine.serving.protocol import (
    ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatMessage, ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionChunk,
    CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, DetokenizeRequest,
    DetokenizeResponse, ModelCard, ModelList, PromptTokensDetails, SamplingFields, TokenizeRequest,
    TokenizeResponse, TopLogprob, UsageInfo, random_id,
)

DONE = "data: [DONE]\n\n"


def sse(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


@dataclass
class _Choice:
    """A choice's running totals while it streams or is collected."""

    parts: list[str] = field(default_factory=list)  # joined once at the end: += would copy it all
    length: int = 0  # characters so far
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, root: str | None = None) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.root = root
        self.created = int(time.time())
        self._tok = llm.tokenizer

    # -- simple routes --------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "invalid_request_error", "model", "model_not_found")

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created, root=self.root,
                                         max_model_len=self.llm.max_model_len)])

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
        if req.messages is not None:
            ids = self.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            ids = self._tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.llm.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = len(self._tok)
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=self._tok.decode(req.tokens))

    def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        conv = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        try:
            return apply_chat_template(self._tok, conv, add_generation_prompt)
        except ValueError as exc:
            raise to_api_error(exc) from None
        except Exception as exc:  # noqa: BLE001 - jinja raises its own types for bad conversations
            raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None

    # -- sampling -------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        names: dict[str, str]) -> SamplingParams:
        """The model's generation_config.json, then OpenAI's defaults, where the request is
        silent (as vLLM's `--generation-config auto`); SamplingParams checks the ranges."""
        kw: dict[str, Any] = {
            "n": req.n, "max_tokens": max_tokens, "seed": req.seed, "logprobs": logprobs,
            "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            "stop_token_ids": list(req.stop_token_ids or []), "min_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
            "logit_bias": _token_keys(req.logit_bias or {}, "logit_bias"),
            "allowed_token_ids": req.allowed_token_ids,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "structured": structured_output(req, names),
        }
        for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                            ("min_p", req.min_p), ("repetition_penalty", req.repetition_penalty),
                            ("presence_penalty", req.presence_penalty),
                            ("frequency_penalty", req.frequency_penalty)):
            if value is not None:
                kw[name] = value
            elif name in self.llm.sampling_defaults:
                kw[name] = self.llm.sampling_defaults[name]
        try:
            return SamplingParams(**kw)
        except ValueError as exc:
            raise to_api_error(exc, names) from None

    async def _start(self, prompts: list[str | list[int]], params: SamplingParams, base_id: str,
                     cache_salt: str | None, names: dict[str, str]
                     ) -> list[tuple[StreamOutput, AsyncIterator[StreamOutput]]]:
        """Submit every prompt and await each one's first delta; all or nothing."""
        gens = [self.llm.generate(p, params, f"{base_id}-{i}", cache_salt) for i, p in enumerate(prompts)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        err = next((f for f in firsts if isinstance(f, BaseException)), None)
        if err is not None:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
            raise to_api_error(err, names) from None
        return list(zip(firsts, gens, strict=True))  # type: ignore[arg-type]

    # -- chat -----------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        names = {"prompt": "messages", "logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        params = self.sampling_params(req, max_tokens, logprobs, names)
        rid = random_id("chatcmpl")
        [(first, gen)] = await self._start([prompt], params, rid, req.cache_salt, names)
        if req.stream:
            return self._chat_stream(rid, first, gen, req.n, req.include_usage, req.continuous_usage)
        choices = [_Choice() for _ in range(req.n)]
        last = await _collect([(first, gen)], choices, 0, req.n)
        return ChatCompletionResponse(
            id=rid, model=self.model_name, usage=_usage([last], choices),
            choices=[ChatChoice(index=i, message=ChatResponseMessage(content=c.text),
                                logprobs=self._chat_logprobs(c.logprobs) if logprobs is not None else None,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for i, c in enumerate(choices)])

    async def _chat_stream(self, rid: str, first: StreamOutput, gen: AsyncIterator[StreamOutput], n: int,
                           include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        try:
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(n)])
            choices = [_Choice() for _ in range(n)]
            async for out in _chain(first, gen):
                for d in out.deltas:
                    _absorb(choices[d.index], d)
                    lp = self._chat_logprobs(d.logprobs) if d.logprobs is not None else None
                    yield chunk([ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text), logprobs=lp,
                                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason)],
                                _usage([out], choices) if continuous_usage else None)
            if include_usage:
                yield chunk([], _usage([out], choices))
            yield DONE
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    def _token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> ChatChoiceLogprobs:
        def top(tid: int, lp: float) -> TopLogprob:
            s = self._token_str(tid)
            return TopLogprob(token=s, logprob=lp, bytes=list(s.encode()))

        content = []
        for lp in lps:
            s = self._token_str(lp.token_id)
            content.append(ChatTokenLogprob(token=s, logprob=lp.logprob, bytes=list(s.encode()),
                                            top_logprobs=[top(t, v) for t, v in lp.top]))
        return ChatChoiceLogprobs(content=content)

    # -- completions ----------------------------------------------------------------
    async def completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        prompts = _prompt_list(req.prompt)
        names: dict[str, str] = {}
        params = self.sampling_params(req, req.max_tokens, req.logprobs, names)
        rid = random_id("cmpl")
        started = await self._start(prompts, params, rid, req.cache_salt, names)
        n, total = req.n, req.n * len(prompts)
        echoes = [self._echo(p) if req.echo else "" for p in prompts]
        if req.stream:
            return self._completion_stream(rid, started, n, echoes, req.include_usage, req.logprobs is not None,
                                           req.continuous_usage)
        choices = [_Choice() for _ in range(total)]
        outs = await asyncio.gather(*(_collect([s], choices, i * n, n) for i, s in enumerate(started)))
        return CompletionResponse(
            id=rid, model=self.model_name, usage=_usage(outs, choices),
            choices=[CompletionChoice(index=i, text=echoes[i // n] + c.text,
                                      logprobs=self._completion_logprobs(c.logprobs, 0)
                                      if req.logprobs is not None else None,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for i, c in enumerate(choices)])

    def _echo(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self._tok.decode(prompt)

    async def _completion_stream(self, rid: str, started: list[tuple[StreamOutput, AsyncIterator[StreamOutput]]],
                                 n: int, echoes: list[str], include_usage: bool, want_logprobs: bool,
                                 continuous_usage: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        choices = [_Choice() for _ in range(n * len(started))]
        lasts: dict[int, StreamOutput] = {}
        try:
            async for p, out in _merge(started):
                lasts[p] = out
                for d in out.deltas:
                    idx = p * n + d.index
                    c = choices[idx]
                    offset = c.length
                    prefix = echoes[p] if c.tokens == 0 and not c.length else ""
                    _absorb(c, d)
                    lp = self._completion_logprobs(d.logprobs, offset) if want_logprobs and d.logprobs else None
                    yield sse(CompletionChunk(id=rid, created=created, model=self.model_name, choices=[
                        CompletionChoice(index=idx, text=prefix + d.text, logprobs=lp, finish_reason=d.finish_reason,
                                         stop_reason=d.stop_reason)],
                        usage=_usage(list(lasts.values()), choices) if continuous_usage else None))
            if include_usage:
                yield sse(CompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                          usage=_usage(list(lasts.values()), choices)))
            yield DONE
        finally:
            await asyncio.gather(*(g.aclose() for _, g in started), return_exceptions=True)  # type: ignore

    def _completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            s = self._token_str(lp.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._token_str(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(s)
        return out


# -- helpers ----------------------------------------------------------------------------
def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _absorb(c: _Choice, d: CompletionDelta) -> None:
    c.parts.append(d.text)
    c.length += len(d.text)
    c.tokens += len(d.token_ids)
    if d.logprobs:
        c.logprobs.extend(d.logprobs)
    if d.finish_reason is not None:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason


async def _chain(first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> AsyncIterator[StreamOutput]:
    yield first
    if not first.finished:
        async for out in gen:
            yield out


async def _collect(started: list[tuple[StreamOutput, AsyncIterator[StreamOutput]]], choices: list[_Choice],
                   base: int, n: int) -> StreamOutput:
    """Drain one primed request into choices[base:base+n]; return its last output."""
    [(first, gen)] = started
    out = first
    try:
        async for out in _chain(first, gen):
            for d in out.deltas:
                _absorb(choices[base + d.index], d)
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
    return out


async def _merge(started: list[tuple[StreamOutput, AsyncIterator[StreamOutput]]]
                 ) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Interleave several primed streams, tagging each item with its prompt's position."""
    if len(started) == 1:
        async for out in _chain(*started[0]):
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, StreamOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> None:
        try:
            async for out in _chain(first, gen):
                await q.put((i, out))
            await q.put((i, None))
        except Exception as exc:  # noqa: BLE001 - surfaced to the consumer below
            await q.put((i, exc))

    tasks = [asyncio.create_task(pump(i, f, g)) for i, (f, g) in enumerate(started)]
    try:
        live = len(tasks)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(outs: list[StreamOutput], choices: list[_Choice]) -> UsageInfo:
    """Each prompt counts once, however many samples it had."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(c.tokens for c in choices)
    cached = PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in outs))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=cached)


def structured_output(req: SamplingFields, names: dict[str, str]) -> StructuredOutput | None:
    """The one constraint a request asks for, however it spells it; `names` learns which
    field it came from, so errors point there."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutput("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        found.append(("response_format", StructuredOutput("json", json.dumps(rf.json_schema.schema_))))
    so = req.structured_outputs
    spelled = [("structured_outputs", kind, value) for kind, value in (
        ("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))] if so else []
    spelled += [("guided_json", "json", req.guided_json), ("guided_regex", "regex", req.guided_regex),
                ("guided_choice", "choice", req.guided_choice), ("guided_grammar", "grammar", req.guided_grammar)]
    for name, kind, value in spelled:
        if value is None:
            continue
        if kind == "choice" and not value:
            raise bad_request("choice needs at least one string", name)
        spec = value if isinstance(value, str) else json.dumps(value)  # a schema or choices as JSON text
        found.append((name, StructuredOutput(kind, spec)))
    if len(found) > 1:
        raise bad_request(f"give one structured-output constraint, not {len(found)} ("
                          + ", ".join(n for n, _ in found) + ")", found[1][0])
    if not found:
        return None
    names["structured_outputs"] = found[0][0]
    return found[0][1]


def _token_keys(mapping: dict[str, float], field: str) -> dict[int, float]:
    """JSON object keys are strings; OpenAI's logit_bias keys are token ids."""
    try:
        return {int(k): v for k, v in mapping.items()}
    except ValueError:
        raise bad_request(f"{field} keys must be token ids, e.g. {{\"50256\": -100}}", field) from None
