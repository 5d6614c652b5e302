"""How the store lays out a call: one row of its `calls` table, and the version spans.

Token ids and logprobs are packed arrays (int32 / float64), not JSON: they are the bulk of
every row, and float64 keeps vLLM's logprobs bit-exact. Version spans are JSON objects with
their keys in the order `version, start, end`, which `version_marker` relies on.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from typing import Any

from lockgate.gateway.schema import CallRecord, VersionSpan

# The columns of the store's `calls` table, in its order (store/trajectories.py creates it).
CALL_COLUMNS = (
    "session_id",
    "idx",
    "request",
    "sampling",
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "versions",
    "finish_reason",
    "replica",
    "started_at",
    "ended_at",
    "interruptions",
    "extends_previous",
)


def pack_ints(values: Sequence[int]) -> bytes:
    return array("i", values).tobytes()


def unpack_ints(blob: bytes) -> list[int]:
    out = array("i")
    out.frombytes(blob)
    return out.tolist()


def pack_floats(values: Sequence[float]) -> bytes:
    return array("d", values).tobytes()


def unpack_floats(blob: bytes) -> list[float]:
    out = array("d")
    out.frombytes(blob)
    return out.tolist()


def pack_spans(spans: Sequence[VersionSpan]) -> str:
    return json.dumps([span.model_dump() for span in spans])


def unpack_spans(text: str) -> list[VersionSpan]:
    return [VersionSpan(**span) for span in json.loads(text)]


def version_marker(version: int) -> str:
    """A substring of a call's packed spans exactly when one of them has `version`: lets SQL
    find the calls sampled under a version without parsing every call's JSON."""
    return f'"version": {version},'


def token_versions(spans: Sequence[VersionSpan], n: int) -> list[int]:
    """The weight version of each of `n` completion tokens; -1 where no span covers one."""
    out = [-1] * n
    for span in spans:
        out[span.start : span.end] = [span.version] * (span.end - span.start)
    return out


def call_to_row(call: CallRecord) -> tuple[Any, ...]:
    """The call as a row of `calls`, in `CALL_COLUMNS` order."""
    return (
        call.session_id,
        call.index,
        json.dumps(call.request),
        json.dumps(call.sampling),
        pack_ints(call.prompt_ids),
        pack_ints(call.completion_ids),
        pack_floats(call.logprobs),
        pack_spans(call.versions),
        call.finish_reason,
        call.replica,
        call.started_at,
        call.ended_at,
        call.interruptions,
        int(call.extends_previous),
    )


def call_from_row(row: Sequence[Any]) -> CallRecord:
    """A row of `calls` read in `CALL_COLUMNS` order, as the record it was written from."""
    return CallRecord(
        session_id=row[0],
        index=row[1],
        request=json.loads(row[2]),
        sampling=json.loads(row[3]),
        prompt_ids=unpack_ints(row[4]),
        completion_ids=unpack_ints(row[5]),
        logprobs=unpack_floats(row[6]),
        versions=unpack_spans(row[7]),
        finish_reason=row[8],
        replica=row[9],
        started_at=row[10],
        ended_at=row[11],
        interruptions=row[12],
        extends_previous=bool(row[13]),
    )
