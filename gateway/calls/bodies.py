"""Request bodies: JSON parsed by orjson and validated against a schema model.

A body that is not a JSON object, or that does not fit its model, is a 400 in OpenAI's shape
naming the first offending field; an unknown field is "unsupported parameter '<field>'" (the
agent-facing models forbid extra fields), never silently ignored.
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from lockgate.gateway.errors import bad_request, too_large

M = TypeVar("M", bound=BaseModel)


# Bodies are recorded and read back (the admin API, the viewer) through orjson, which writes at
# most 254 levels of nesting, a record's and an answer's own levels around the body's. A chat
# call with 300 levels in a message's `audio` was answered and recorded, and then its session's
# calls could not be read (a 500; found by fuzzing, issue 18). So a body may nest as deep as
# leaves room for what is put around it. Real requests, tool schemas included, nest a few levels.
_ORJSON_DEPTH = 254
_AROUND_A_BODY = 16  # levels a record or an answer puts around a body, with room to spare
MAX_JSON_DEPTH = _ORJSON_DEPTH - _AROUND_A_BODY


# orjson holds the GIL for a whole parse, so parsing a body holds the event loop every other
# call shares, for a time that grows with its JSON values. A body over _COUNTED_FROM bytes has
# its values counted first (commas and openers, which also counts those inside strings: an
# upper bound) by bytes.count, far cheaper than a parse, and one over the bound is refused
# unparsed. The default bound keeps a parse's hold on the loop short and is far above what a
# prompt that fits a context needs (the costs: docs/reliability.md).
DEFAULT_MAX_JSON_VALUES = 262_144
_COUNTED_FROM = 256 * 1024


def parse_json(body: bytes, max_values: int = DEFAULT_MAX_JSON_VALUES) -> dict[str, Any]:
    """The body as a JSON object; a 400 when it is not one, a 413 when it holds more than
    about `max_values` values (0: no bound)."""
    if max_values and len(body) > _COUNTED_FROM:
        values = body.count(b",") + body.count(b"{") + body.count(b"[")
        if values > max_values:
            raise too_large(
                f"the request body holds about {values} JSON values; at most {max_values} are "
                "taken (a bound on the work of parsing one request)"
            )
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """A body nested deeper than `MAX_JSON_DEPTH` is a 400.

    Checked by orjson itself: under `_AROUND_A_BODY` wrapping lists its own limit falls exactly
    there. That costs a few microseconds for a usual chat body, where a walk in Python costs
    tens (this is every call's path), and milliseconds for the largest.
    """
    wrapped = value
    for _ in range(_AROUND_A_BODY):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError as exc:
        raise bad_request(
            f"the request body is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from exc


def validate(model: type[M], raw: dict[str, Any]) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        kind = first["type"]
        msg = (
            f"unsupported parameter '{where}'"
            if kind == "extra_forbidden"
            else f"{where}: {first['msg']}"
        )
        raise bad_request(msg, param=where or None) from exc
