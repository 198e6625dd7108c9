"""Token log-probabilities in OpenAI's shapes: chat's per-token objects, the completions
API's legacy parallel lists (with the echoed prompt's tokens), and vLLM's prompt_logprobs.
Each token is shown as the text of that token alone, special tokens included."""

from __future__ import annotations

from typing import Any

from engine.client.async_llm import StreamOutput
from engine.messages import TokenLogprobs
from engine.serving.openai.replies import (
    ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob,
)


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def chat(self, lps: list[TokenLogprobs]) -> ChatChoiceLogprobs:
        def top(tid: int, lp: float) -> TopLogprob:
            s = self.token(tid)
            return TopLogprob(token=s, logprob=lp, bytes=list(s.encode()))

        content = []
        for lp in lps:
            s = self.token(lp.token_id)
            content.append(ChatTokenLogprob(token=s, logprob=lp.logprob, bytes=list(s.encode()),
                                            top_logprobs=[top(t, v) for t, v in lp.top]))
        return ChatChoiceLogprobs(content=content)

    def completion(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        """Generated tokens; `offset` is where the first starts in the choice's text."""
        out = CompletionLogprobs()
        for lp in lps:
            s = self.token(lp.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def echo(self, out: StreamOutput, k: int) -> CompletionLogprobs:
        """The echoed prompt's tokens in the legacy shape: the first has no logprob."""
        lps = CompletionLogprobs()
        offset = 0
        for tid, lp in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            s = self.token(tid)
            lps.tokens.append(s)
            lps.text_offset.append(offset)
            lps.token_logprobs.append(None if lp is None else lp.logprob)
            lps.top_logprobs.append(None if lp is None else {self.token(t): v for t, v in lp.top[:k]})
            offset += len(s)
        return lps

    def prompt(self, out: StreamOutput, k: int | None = -1) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token, it and its top k by token id (k=-1: as asked)."""
        if out.prompt_logprobs is None or k is None:
            return None
        result: PromptLogprobs = []
        for lp in out.prompt_logprobs:
            if lp is None:
                result.append(None)
                continue
            top = lp.top if k < 0 else lp.top[:k]
            entry = {str(t): PromptLogprob(logprob=v, rank=r, decoded_token=self.token(t))
                     for r, (t, v) in enumerate(top, start=1)}
            entry.setdefault(str(lp.token_id), PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                             decoded_token=self.token(lp.token_id)))
            result.append(entry)
        return result


def join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """The echoed prompt's lists, then the generated tokens'."""
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs)
