"""The run dashboard's data: the step records of a run's metrics.jsonl, shaped into columns.

The coordinator writes one JSON line per trainer step; `lockgate report` plots the same file
after the run. Here it is read while the run writes it, through the file's one reader
(`read_metrics`, which skips a partial last line), and re-read only when its size or mtime
moved.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from lockgate.gateway.records.metrics_file import (
    STEP,
    Batch,
    Count,
    MetricsFileError,
    Perf,
    Reward,
    Staleness,
    Sync,
    Time,
    Val,
    count_key,
    read_metrics,
)

STALE_DROPS = count_key(Count.GROUPS_DROPPED_STALE)

# Columns sent as they are logged (None where a step did not log one); static/viewer.js plots
# them by these keys.
COLUMNS = (
    Reward.MEAN,
    Reward.MIN,
    Reward.MAX,
    Val.VERSION,
    Val.REWARD_MEAN,
    Staleness.MEAN,
    Staleness.MAX,
    Perf.GEN_TOKENS_PER_S,
    Perf.REPLICA_IDLE_FRAC,
    Time.STEP_S,
    Time.TRAIN_S,
    Time.WAIT_FOR_GROUPS_S,
    Time.SYNC_S,
    Sync.VERSION,
    Sync.STAGE_S,
    Sync.PAUSE_LATENCY_S,
    Sync.LOAD_S,
    Sync.RESUME_S,
    Sync.DURATION_S,
    Sync.INTERRUPTED,
    Sync.TOKENS_KEPT,
    STALE_DROPS,
    count_key(Count.GROUPS_DROPPED_ZERO_VARIANCE),
    count_key(Count.INTERRUPTED_SEGMENTS),
    count_key(Count.RERENDER_SPLITS),
    Batch.LOSS_TOKENS,
)


class RunMetrics(BaseModel):
    available: bool  # False: no metrics.jsonl (a gateway serving outside a run dir, say)
    error: str | None = None  # why the file could not be read (a line that is no step record)
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


def shape(records: list[dict[str, Any]], path: str = "") -> RunMetrics:
    columns = {key: [_num(r, key) for r in records] for key in COLUMNS}
    idle: list[float | None] = []
    for r in records:
        train, step = _num(r, Time.TRAIN_S), _num(r, Time.STEP_S)
        if step is None:
            parts = [_num(r, k) for k in (Time.WAIT_FOR_GROUPS_S, Time.TRAIN_S, Time.SYNC_S)]
            step = sum(p for p in parts if p is not None) if any(parts) else None
        idle.append(1.0 - train / step if train is not None and step else None)
    drops: list[float | None] = []
    before = 0.0
    for total in columns[STALE_DROPS]:
        drops.append(None if total is None else total - before)
        before = before if total is None else total
    hist = [
        {str(k): int(v) for k, v in r[Staleness.HIST].items()}
        if isinstance(r.get(Staleness.HIST), dict)
        else {}
        for r in records
    ]
    return RunMetrics(
        available=True,
        path=path,
        steps=[int(r[STEP]) for r in records],
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
                try:
                    self._shaped = shape(read_metrics(self.path), str(self.path))
                except MetricsFileError as exc:
                    self._shaped = empty.model_copy(update={"error": str(exc)})
                except OSError:
                    return empty
                self._seen = key
            return self._shaped
