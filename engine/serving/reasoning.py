"""Reasoning parsers: a `<think>...</think>` block apart from the answer, as it streams.

`service.reasoning_parser` picks one:
- `qwen3`: reasoning is what the model writes between its own <think> and </think>
  (Qwen3 with enable_thinking off writes no block, and everything is content);
- `deepseek_r1`: the chat template opens the block in the prompt, so the output starts
  inside it and reasoning runs to </think> (a <think> the model repeats at the start is
  dropped).

The split is the same however the text is cut into deltas: tags that straddle two
deltas are held back until they are decided. The answer's leading newlines after
</think> are dropped, as the templates put them there only to separate the two.
Tool calls are parsed from the content alone, so nothing inside the block becomes a call.
"""

from __future__ import annotations

from typing import Literal

from engine.serving.tools.formats import partial_suffix

START, END = "<think>", "</think>"
ReasoningParserName = Literal["qwen3", "deepseek_r1"]


class ReasoningParser:
    def __init__(self, name: ReasoningParserName) -> None:
        self.inside = name == "deepseek_r1"
        self.fresh = self.inside  # nothing seen yet: a leading <think> is the model repeating the prompt's
        self.trim = False  # drop newlines that open the answer
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be shown now."""
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.fresh:
                if len(self.buf) < len(START) and START.startswith(self.buf):
                    break  # may still be a leading <think>
                self.buf = self.buf.removeprefix(START)
                self.fresh = False
                continue
            tag = END if self.inside else START
            at = self.buf.find(tag)
            cut = at if at >= 0 else len(self.buf) - partial_suffix(self.buf, tag)
            self._emit(self.buf[:cut], reasoning, content)
            if at < 0:
                self.buf = self.buf[cut:]
                break
            self.buf = self.buf[at + len(tag):]
            self.inside = not self.inside
            self.trim = not self.inside
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output (an unclosed block is reasoning)."""
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(self.buf, reasoning, content)
        self.buf = ""
        return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self.inside:
            reasoning.append(text)
            return
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        content.append(text)
