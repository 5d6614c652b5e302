"""Step metrics: one JSONL line per trainer step, a one-line progress report on stderr, and
the configured dashboards (`sinks.py`).

The file's format, its keys and its reader belong to `lockgate.gateway.records.metrics_file`:
the viewer's dashboard reads the same file and may import nothing of the coordinator."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from lockgate.coordinator.metrics.sinks import MetricSink, SinkFanout
from lockgate.gateway.records.metrics_file import (
    STEP,
    Count,
    Perf,
    Reward,
    Staleness,
    Time,
    count_key,
)


class MetricsLog:
    def __init__(
        self,
        path: Path,
        total_steps: int,
        stream: TextIO | None = None,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)
        self._total = total_steps
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()
        # Run totals for the status line: per-step rates swing between 0 and bursts because a
        # group's tokens are counted when the group completes.
        self._tokens = 0.0
        self._step_s = 0.0
        self._train_s = 0.0
        # The run's failed rollouts at the previous line; unknown before a resumed run's first
        # line (its counters start from its checkpoint's, not from zero).
        self._failed: int | None = None
        self._sinks = SinkFanout(sinks)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._print(record)
        self._sinks.write(record)

    def _print(self, r: dict[str, Any]) -> None:
        step = int(r[STEP])
        elapsed = time.monotonic() - self._started
        eta = elapsed / max(step, 1) * (self._total - step)
        step_s = float(r.get(Time.STEP_S, 0.0))
        self._tokens += float(r[Perf.GEN_TOKENS_PER_S]) * step_s
        self._step_s += step_s
        self._train_s += float(r[Time.TRAIN_S])
        rate = self._tokens / self._step_s if self._step_s > 0 else 0.0
        idle = 1.0 - self._train_s / self._step_s if self._step_s > 0 else 0.0
        self._stream.write(
            f"step {step:>3}/{self._total} | reward {r[Reward.MEAN]:.3f}"
            f" | gen {rate:.0f} tok/s | trainer idle {100 * idle:.0f}%"
            f" | staleness {r[Staleness.MEAN]:.2f} (max {r[Staleness.MAX]:.0f})"
            f" | train {r[Time.TRAIN_S]:.1f}s | sync {r[Time.SYNC_S]:.2f}s"
            f"{self._failures(r)} | elapsed {_fmt(elapsed)} eta {_fmt(eta)}\n"
        )
        self._stream.flush()

    def _failures(self, r: dict[str, Any]) -> str:
        """The run's failed rollouts, once there are any: a service or command that fails must
        show on the line an operator watches, not only in the records."""
        failed = int(r.get(count_key(Count.ROLLOUTS_FAILED), 0))
        before = 0 if int(r[STEP]) == 1 else self._failed
        new = None if before is None else failed - before
        self._failed = failed
        if not failed:
            return ""
        return f" | failed rollouts {failed}" + (f" (+{new})" if new else "")

    def close(self) -> None:
        self._file.close()
        self._sinks.close()


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"
