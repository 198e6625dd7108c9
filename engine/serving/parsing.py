"""Request bodies into protocol models: read within a byte limit, JSON bounded as every
body is (jsontext), and schema errors as OpenAI 400s naming the field in the client's
own document; the lenient parse drops unknown fields and says which."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from engine.serving import jsontext
from engine.serving.errors import APIError, bad_request

DEFAULT_MAX_BODY = 8 << 20

UnknownFields = Literal["reject", "warn"]
IGNORED_HEADER = "X-Ignored-Fields"  # what a lenient parse dropped, so the client can see it too


def parse(body: bytes, model: type[BaseModel], unknown: UnknownFields = "reject") -> tuple[Any, list[str]]:
    """The request, and the unknown fields dropped from it (`warn`; `reject` makes the
    first one a 400). JSON and schema errors become OpenAI 400s naming the field."""
    data = jsontext.loads(body)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    ignored: list[str] = []
    for _ in range(8):  # each pass drops what it finds; a union can hide a nested one until the next
        try:
            return model.model_validate(data), sorted(ignored)
        except ValidationError as exc:
            errs = exc.errors(include_url=False)
            extra = [e for e in errs if e["type"] == "extra_forbidden"]
            if unknown == "warn" and extra:
                for e in extra:
                    ignored.append(_drop(data, e["loc"]))
                continue
            # the deepest place in the client's document: in a union, the member that got furthest
            err, loc = max(((e, _json_path(data, e["loc"])) for e in (extra or errs)),
                           key=lambda el: el[1].count(".") + el[1].count("["))
            if err["type"] == "extra_forbidden":  # OpenAI's wording for a field it does not know
                raise bad_request(f"Unrecognized request argument supplied: {loc}", loc) from None
            msg = err["msg"].removeprefix("Value error, ")
            raise bad_request(f"{loc}: {msg}" if loc else msg, loc or None) from None
    raise bad_request("too many unrecognized fields: " + ", ".join(ignored[:20]), ignored[0] if ignored else None)


MAX_SHOWN_FIELD = 64  # characters of one ignored field's name in the header and the log


def shown_fields(names: list[str], most: int = 16) -> str:
    """Ignored field names as a header value and a log line may carry them: printable ASCII
    only (a name is the client's text: non-Latin-1 made the header a 500 after the whole
    generation, CR/LF forged log lines), each cut short, at most `most`, with a count."""
    def one(name: str) -> str:
        safe = name.encode("ascii", "backslashreplace").decode("ascii")
        safe = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in safe)
        return safe if len(safe) <= MAX_SHOWN_FIELD else safe[:MAX_SHOWN_FIELD] + "..."
    shown = ", ".join(one(n) for n in names[:most])
    return shown + (f" (and {len(names) - most} more)" if len(names) > most else "")


def _drop(data: Any, loc: tuple[Any, ...]) -> str:
    """Remove the unknown key at `loc` from the client's JSON; its path there."""
    path, node = _walk(data, loc[:-1])
    if isinstance(node, dict):
        node.pop(loc[-1], None)
    return f"{path}.{loc[-1]}".lstrip(".")


def _json_path(data: Any, loc: tuple[Any, ...]) -> str:
    """The error's location in the client's JSON, e.g. messages[0].role; a missing
    top-level field is its own name."""
    path, _ = _walk(data, loc)
    return path or (loc[0] if loc and isinstance(loc[0], str) else "")


def _walk(data: Any, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """Follow a pydantic error location through the client's JSON: the path it reaches
    (e.g. messages[0].content) and the node there. pydantic puts union members ("str",
    "list[int]", a tag) into loc; those are not in the document, so the walk skips what
    it cannot find there."""
    path, node = "", data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            path += f"[{part}]"
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            path += f".{part}"
        else:
            continue
        node = node[part]
    return path.lstrip("."), node


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes, however it is sent."""
    too_big = APIError(413, f"the request body is larger than {limit} bytes", "invalid_request_error", None,
                       "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
