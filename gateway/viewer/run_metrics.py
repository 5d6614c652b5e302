"""The run dashboard's data: the step records of a run's metrics.jsonl, shaped into columns.

The coordinator writes one JSON line per trainer step (coordinator/metrics/log.py); `lockgate
report` plots the same file after the run. Here it is read while the run writes it: a last
line not yet complete is skipped, and the file is re-read only when its size or mtime moved.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel

# Columns sent as they are logged (None where a step did not log one).
COLUMNS = (
    "reward/mean",
    "reward/min",
    "reward/max",
    "val/version",
    "val/reward_mean",
    "staleness/mean",
    "staleness/max",
    "perf/gen_tokens_per_s",
    "perf/replica_idle_frac",
    "time/step_s",
    "time/train_s",
    "time/wait_for_groups_s",
    "time/sync_s",
    "sync/version",
    "sync/stage_s",
    "sync/pause_latency_s",
    "sync/load_s",
    "sync/resume_s",
    "sync/duration_s",
    "sync/interrupted",
    "sync/tokens_kept",
    "count/groups_dropped/stale",
    "count/groups_dropped/zero_variance",
    "count/interrupted_segments",
    "count/rerender_splits",
    "batch/loss_tokens",
)


class RunMetrics(BaseModel):
    available: bool  # False: no metrics.jsonl (a gateway serving outside a run dir, say)
    path: str
    steps: list[int]
    columns: dict[str, list[float | None]]
    trainer_idle_frac: list[float | None]  # 1 - train_s / step_s
    stale_drops: list[float | None]  # groups dropped as too stale during each step
    staleness_hist: list[dict[str, int]]  # per step: versions behind -> tokens


def _num(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def parse_records(text: str) -> list[dict[str, Any]]:
    """Step records in file order; lines that are not complete JSON objects with a step are
    skipped (the last one may be mid-write)."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int | float):
            records.append(record)
    return records


def shape(records: list[dict[str, Any]], path: str = "") -> RunMetrics:
    columns = {key: [_num(r, key) for r in records] for key in COLUMNS}
    idle: list[float | None] = []
    for r in records:
        train, step = _num(r, "time/train_s"), _num(r, "time/step_s")
        if step is None:
            parts = [_num(r, k) for k in ("time/wait_for_groups_s", "time/train_s", "time/sync_s")]
            step = sum(p for p in parts if p is not None) if any(parts) else None
        idle.append(1.0 - train / step if train is not None and step else None)
    drops: list[float | None] = []
    before = 0.0
    for total in columns["count/groups_dropped/stale"]:
        drops.append(None if total is None else total - before)
        before = before if total is None else total
    hist = [
        {str(k): int(v) for k, v in r["staleness/hist"].items()}
        if isinstance(r.get("staleness/hist"), dict)
        else {}
        for r in records
    ]
    return RunMetrics(
        available=True,
        path=path,
        steps=[int(r["step"]) for r in records],
        columns=columns,
        trainer_idle_frac=idle,
        stale_drops=drops,
        staleness_hist=hist,
    )


class MetricsFile:
    """metrics.jsonl, re-read only when it changed (the dashboard polls it)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self._shaped: RunMetrics | None = None

    def read(self) -> RunMetrics:
        empty = RunMetrics(
            available=False,
            path=str(self.path or ""),
            steps=[],
            columns={},
            trainer_idle_frac=[],
            stale_drops=[],
            staleness_hist=[],
        )
        if self.path is None:
            return empty
        try:
            st = os.stat(self.path)
        except OSError:
            return empty
        with self._lock:
            key = (st.st_size, st.st_mtime_ns)
            if self._shaped is None or key != self._seen:
                text = self.path.read_text(errors="replace")
                self._shaped = shape(parse_records(text), str(self.path))
                self._seen = key
            return self._shaped
