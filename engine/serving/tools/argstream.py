"""A tool call's arguments, streamed as the model writes them.

The model's JSON arrives a few characters at a time, spaced and escaped its own way;
the client joins the fragments we send and parses them, and the joined text must be
exactly what the whole answer carries: `json.dumps(json.loads(raw), ensure_ascii=False)`.
So the raw text is lexed as it comes and each piece is written out in that form as soon
as it is settled: punctuation with json.dumps' separators, strings character by
character (an escape once it is whole, a surrogate pair once both halves are in),
numbers and literals once the character after them shows they have ended.
"""

from __future__ import annotations

import json
import re

from engine.serving.jsontext import MAX_DEPTH

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]*")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_CLOSER = {"{": "}", "[": "]"}


class ArgStream:
    """Feed raw text that starts with the arguments object; get back the canonical text
    settled so far. `done` once the object closes (`rest` holds what followed it);
    `broken` once the text stops being JSON a client could take (nothing more comes)."""

    def __init__(self) -> None:
        self.buf = ""
        self.stack: list[str] = []  # "{" or "[" for each open container
        self.expect = "object"  # object | value | key | colon | next | string
        self.empty = False  # the innermost container has nothing in it yet
        self.in_key = False
        self.high: str | None = None  # a high surrogate waiting for its low half
        self.done = False
        self.broken = False
        self.rest = ""

    def feed(self, text: str, final: bool = False) -> str:
        """`final`: no more text follows, so a number at the very end has ended."""
        if self.done or self.broken:
            self.rest += text
            return ""
        self.buf += text
        out: list[str] = []
        while self.buf and not (self.done or self.broken) and self._step(out, final):
            pass
        if self.done:
            self.rest, self.buf = self.buf, ""
        return "".join(out)

    def _step(self, out: list[str], final: bool) -> bool:
        """Move one piece of buf to out; False when buf ends inside the piece."""
        if self.expect == "string":
            return self._string(out)
        if self.buf[0] in " \t\r\n":
            self.buf = self.buf.lstrip(" \t\r\n")
            return True
        c = self.buf[0]
        if self.expect == "object":
            return self._open(out, c) if c == "{" else self._break()
        if self.expect == "colon":
            return self._take(out, c == ":", ": ", "value")
        if self.expect == "next":
            if c == ",":
                return self._take(out, True, ", ", "key" if self.stack[-1] == "{" else "value")
            return self._close(out, c)
        if self.expect == "key":
            if c == '"':
                return self._start_string(out, key=True)
            return self._close(out, c) if c == "}" and self.empty else self._break()
        if c == "]" and self.empty:
            return self._close(out, c)
        if c in "{[":
            return self._open(out, c)
        if c == '"':
            return self._start_string(out, key=False)
        return self._scalar(out, final)

    def _take(self, out: list[str], ok: bool, text: str, then: str) -> bool:
        if not ok:
            return self._break()
        self.buf = self.buf[1:]
        out.append(text)
        self.expect = then
        return True

    def _open(self, out: list[str], c: str) -> bool:
        if len(self.stack) >= MAX_DEPTH:
            return self._break()
        self.stack.append(c)
        self.empty = True
        return self._take(out, True, c, "key" if c == "{" else "value")

    def _close(self, out: list[str], c: str) -> bool:
        if not self.stack or c != _CLOSER[self.stack[-1]]:
            return self._break()
        self.stack.pop()
        self.empty = False
        self.done = not self.stack
        return self._take(out, True, c, "next")

    def _start_string(self, out: list[str], key: bool) -> bool:
        self.empty, self.in_key = False, key
        return self._take(out, True, '"', "string")

    def _string(self, out: list[str]) -> bool:
        i, chars = 0, []
        ended = False
        while i < len(self.buf):
            c = self.buf[i]
            if c == '"':
                if self.high is not None:
                    return self._break()
                i, ended = i + 1, True
                break
            if c == "\\":
                e = self.buf[i + 1:i + 2]
                if not e:
                    break
                if e in _ESCAPES:
                    ch, step = _ESCAPES[e], 2
                elif e == "u":
                    hexa = self.buf[i + 2:i + 6]
                    if len(hexa) < 4:
                        break
                    if not re.fullmatch(r"[0-9a-fA-F]{4}", hexa):
                        return self._break()
                    ch, step = chr(int(hexa, 16)), 6
                else:
                    return self._break()
            elif ord(c) < 0x20:
                return self._break()  # a raw control character: not JSON
            else:
                ch, step = c, 1
            i += step
            if self.high is not None:  # the low half must follow at once
                if not 0xDC00 <= ord(ch) <= 0xDFFF:
                    return self._break()
                ch, self.high = (self.high + ch).encode("utf-16", "surrogatepass").decode("utf-16"), None
            elif 0xD800 <= ord(ch) <= 0xDBFF:
                self.high = ch
                continue
            elif 0xDC00 <= ord(ch) <= 0xDFFF:
                return self._break()  # a lone low half is not Unicode
            chars.append(ch)
        self.buf = self.buf[i:]
        out.append(json.dumps("".join(chars), ensure_ascii=False)[1:-1] + ('"' if ended else ""))
        if ended:
            self.expect = "colon" if self.in_key else "next"
        return ended

    def _scalar(self, out: list[str], final: bool) -> bool:
        for word in _LITERALS:
            if self.buf.startswith(word):
                self.buf = self.buf[len(word):]
                out.append(word)
                self.expect = "next"
                return True
            if word.startswith(self.buf):
                return False  # the rest of the word has not come yet
        run = _NUMBER_CHARS.match(self.buf).group()
        if not run:
            return self._break()
        if len(run) == len(self.buf) and not final:
            return False  # the number may go on
        if not _NUMBER.fullmatch(run):
            return self._break()
        value = json.loads(run)
        if isinstance(value, float) and abs(value) == float("inf"):
            return self._break()  # 1e999: no client can take it
        self.buf = self.buf[len(run):]
        out.append(json.dumps(value))
        self.expect = "next"
        return True

    def _break(self) -> bool:
        self.broken = True
        return False
