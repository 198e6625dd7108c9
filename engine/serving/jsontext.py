"""JSON from clients, bounded: request bodies and the JSON text carried inside them.

Python's json module recurses, so text nested a few thousand deep raises RecursionError,
which no `except ValueError` catches; what parses must also stay shallow enough for
everything downstream (xgrammar compiles a schema in the engine core, on the step loop,
so a deep schema would stall every request). One rule serves the body and the JSON
strings inside it (tool-call arguments, schemas sent as text): at most MAX_DEPTH levels,
finite numbers, integers within 64 bits, and strings that are valid Unicode.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.serving.errors import APIError, bad_request

MAX_DEPTH = 64  # deeper than any real request (a JSON schema included), and far from RecursionError
INT64 = range(-(2**63), 2**63)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def loads(text: str | bytes, field: str | None = None, what: str = "the request body") -> Any:
    """Parse and check `text`; a 400 naming `field` when it is not JSON this server takes."""
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise bad_request(f"{what} is nested deeper than {MAX_DEPTH} levels", field) from None
    except ValueError as exc:  # bad JSON, bad UTF-8, NaN or Infinity
        raise bad_request(f"{what} is not valid JSON: {exc}", field) from None
    try:
        check_values(data)
    except APIError as exc:  # a path inside JSON text is not in the client's document: name the field
        if field is not None:
            exc.detail.param = field
        raise
    return data


def check_values(data: Any) -> None:
    """Refuse what JSON can carry but nothing downstream should see: nesting past MAX_DEPTH,
    numbers too large for any field (1e400 parses as infinity), and strings that are not
    Unicode (a lone surrogate escape such as "\\ud800" cannot be encoded, tokenized or echoed)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request is nested deeper than {MAX_DEPTH} levels", path.lstrip(".") or None)
        if isinstance(node, dict):
            for k, v in node.items():
                _check_str(k, path)
                stack.append((v, f"{path}.{k}", depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
        elif isinstance(node, str):
            _check_str(node, path)
        elif isinstance(node, float) and not math.isfinite(node):
            raise bad_request("numbers must be finite", path.lstrip(".") or None)
        elif isinstance(node, int) and not isinstance(node, bool) and node not in INT64:
            raise bad_request("integers must fit in 64 bits", path.lstrip(".") or None)


def _check_str(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("strings must be valid Unicode (a lone surrogate is not)", path.lstrip(".") or None) from None


def model_json(text: str) -> Any:
    """JSON the model wrote, or None where it is not JSON we would hand a client: the
    model's output is data, and text that does not parse stays text."""
    try:
        data = json.loads(text, parse_constant=_no_constants)
        check_values(data)
    except Exception:  # noqa: BLE001 - ValueError, RecursionError and the 400s above alike
        return None
    return data
