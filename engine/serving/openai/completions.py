"""`/v1/completions`: prompts (text, token ids, or a batch of either) x n choices, with
echo, the legacy logprobs shape and streaming; on the shared OpenAIServing intake."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.client.async_llm import StreamOutput
from engine.serving.errors import bad_request
from engine.serving.openai import logprobs as lp_format
from engine.serving.openai.protocol import CompletionRequest, random_id
from engine.serving.openai.replies import CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse
from engine.serving.openai.streams import DONE, Choice, Started, absorb, collect, merge, prompt_list, sse, usage

if TYPE_CHECKING:
    from engine.serving.openai.handlers import OpenAIServing


async def complete(serving: OpenAIServing, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
    serving.check_model(req.model)
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
    given = prompt_list(req.prompt)
    if len(given) * req.n > serving.max_sequences:
        raise bad_request(f"{len(given)} prompts x n={req.n} is {len(given) * req.n} sequences; at most "
                          f"{serving.max_sequences} are accepted in one request", "prompt" if req.n == 1 else "n")
    prompts = await serving.prompts_ids(given)
    names: dict[str, str] = {}
    # echo with logprobs scores the echoed prompt too, with as many alternatives as the output
    echo_lps = req.logprobs if req.echo and req.logprobs is not None else None
    plps = max(req.prompt_logprobs or 0, echo_lps) if echo_lps is not None else None
    params = serving.sampling_params(req, req.max_tokens, req.logprobs, names, prompt_logprobs=plps)
    rid = random_id("cmpl")
    started = await serving.start(prompts, params, rid, req, names)
    n, total = req.n, req.n * len(prompts)
    # a text prompt echoes as sent; token ids as their text
    echoes = [(p if isinstance(p, str) else serving.tokenizer.decode(p)) if req.echo else "" for p in given]
    fmt = serving.logprobs
    if req.stream:
        return _stream(serving.model_name, fmt, rid, started, n, echoes, req.include_usage, req.logprobs,
                       echo_lps is not None, req.continuous_usage)
    choices = [Choice() for _ in range(total)]
    outs = await asyncio.gather(*(collect([s], choices, i * n, n) for i, s in enumerate(started)))
    result = []
    for i, c in enumerate(choices):
        out, lp = outs[i // n], None
        if req.logprobs is not None:
            lp = fmt.completion(c.logprobs, len(echoes[i // n]))
            if echo_lps is not None:
                lp = lp_format.join(fmt.echo(out, echo_lps), lp)
        result.append(CompletionChoice(index=i, text=echoes[i // n] + c.text, logprobs=lp,
                                       finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                       prompt_logprobs=fmt.prompt(out, req.prompt_logprobs)))
    return CompletionResponse(id=rid, model=serving.model_name, usage=usage(outs), choices=result)


async def _stream(model: str, fmt: lp_format.LogprobFormatter, rid: str, started: list[Started], n: int,
                  echoes: list[str], include_usage: bool, logprobs: int | None, echo_logprobs: bool,
                  continuous_usage: bool = False) -> AsyncIterator[str]:
    created = int(time.time())
    choices = [Choice() for _ in range(n * len(started))]
    lasts: dict[int, StreamOutput] = {}
    prompt_lps: dict[int, CompletionLogprobs] = {}
    try:
        async for p, out in merge(started):
            lasts[p] = out
            if echo_logprobs and out.prompt_logprobs is not None:
                prompt_lps[p] = fmt.echo(out, logprobs or 0)
            for d in out.deltas:
                idx = p * n + d.index
                c = choices[idx]
                first = not c.parts
                prefix = echoes[p] if first else ""
                offset = c.length + len(echoes[p])
                absorb(c, d)
                lp = fmt.completion(d.logprobs, offset) if logprobs is not None and d.logprobs else None
                if first and p in prompt_lps and lp is not None:
                    lp = lp_format.join(prompt_lps[p], lp)
                yield sse(CompletionChunk(id=rid, created=created, model=model, choices=[
                    CompletionChoice(index=idx, text=prefix + d.text, logprobs=lp, finish_reason=d.finish_reason,
                                     stop_reason=d.stop_reason)],
                    usage=usage(list(lasts.values())) if continuous_usage else None))
        if include_usage:
            yield sse(CompletionChunk(id=rid, created=created, model=model, choices=[],
                                      usage=usage(list(lasts.values()))))
        yield DONE
    finally:
        await asyncio.gather(*(g.aclose() for _, g in started), return_exceptions=True)  # type: ignore
