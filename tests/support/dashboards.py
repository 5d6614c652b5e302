"""Readers for what the metric sinks write, so tests check the files the dashboards load."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_RECORD_HEADER = 7  # crc32c (4), length (2), chunk type (1): LevelDB's log format
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard itself loads them (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_histograms(log_dir: Path, tag: str) -> dict[int, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return {e.step: e.histogram_value for e in acc.Histograms(tag)}


def _wandb_chunks(data: bytes) -> list[bytes]:
    """The records of a `.wandb` file: a 7-byte W&B header, then LevelDB log blocks."""
    if data[:4] != b":W&B":
        raise ValueError("not a .wandb file")
    records: list[bytes] = []
    partial = b""
    pos = _RECORD_HEADER
    while pos + _RECORD_HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _RECORD_HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        body = data[pos + _RECORD_HEADER : pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == _FULL:
            records.append(body)
        elif kind == _FIRST:
            partial = body
        elif kind == _MIDDLE:
            partial += body
        elif kind == _LAST:
            records.append(partial + body)
        elif kind == 0 and length == 0:
            break  # zero-filled preallocated tail
    return records


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The rows a W&B run logged (`run.log`), from its `.wandb` file, decoded."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for chunk in _wandb_chunks(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
