"""Which constraint a request asks for, however it spells it, as engine types."""

from __future__ import annotations

import json

from engine.sampling_params import Constraint
from engine.serving import jsontext
from engine.serving.errors import bad_request
from engine.serving.openai.protocol import SamplingFields


def structured_output(req: SamplingFields, names: dict[str, str], tool_call: Constraint | None = None
                      ) -> Constraint | None:
    """The one constraint a request asks for, however it spells it (a forced tool call is
    one too); `names` learns which field it came from, so errors point there."""
    found: list[tuple[str, Constraint]] = [("tools", tool_call)] if tool_call else []  # their schemas
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        found.append(("response_format", Constraint("json", json.dumps(rf.json_schema.schema_))))
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
        if kind == "json" and isinstance(value, str):  # a schema sent as text is bounded like the body
            value = jsontext.loads(value, name, "the JSON schema")
        spec = value if isinstance(value, str) else json.dumps(value)  # a schema or choices as JSON text
        found.append((name, Constraint(kind, spec)))
    if len(found) > 1:
        raise bad_request(f"give one structured-output constraint, not {len(found)} ("
                          + ", ".join(n for n, _ in found) + ")", found[1][0])
    if not found:
        return None
    names["structured_outputs"] = found[0][0]
    return found[0][1]


def token_keys(mapping: dict[str, float], field: str, vocab_size: int) -> dict[int, float]:
    """JSON object keys are strings; OpenAI's logit_bias keys are token ids, bounded here by
    the vocabulary, so no id of any size travels further."""
    out = {}
    for k, v in mapping.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 12 and int(k) < vocab_size):
            raise bad_request(f"{field} keys must be token ids in [0, {vocab_size}), e.g. {{\"50256\": -100}}; "
                              f"got {k[:40]!r}", field)
        out[int(k)] = v
    return out
