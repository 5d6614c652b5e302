"""The per-step status line: run-so-far rates, not the burst of the last step."""

from __future__ import annotations

import io
import json
from pathlib import Path

from lockgate.coordinator.metrics.log import MetricsLog


def _record(step: int, tokens_per_s: float, step_s: float, train_s: float) -> dict[str, float]:
    return {
        "step": step,
        "reward/mean": 0.5,
        "perf/gen_tokens_per_s": tokens_per_s,
        "staleness/mean": 0.0,
        "staleness/max": 0,
        "time/step_s": step_s,
        "time/train_s": train_s,
        "time/sync_s": 0.0,
    }


def test_status_line_shows_the_runs_generation_rate_and_trainer_idle(tmp_path: Path) -> None:
    out = io.StringIO()
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=2, stream=out)
    log.write(_record(1, tokens_per_s=300.0, step_s=2.0, train_s=1.0))  # 600 tokens
    log.write(_record(2, tokens_per_s=0.0, step_s=1.0, train_s=1.0))  # none completed
    log.close()
    first, second = out.getvalue().splitlines()
    assert "gen 300 tok/s | trainer idle 50%" in first
    assert "gen 200 tok/s | trainer idle 33%" in second  # 600 tokens / 3 s; 1 - 2 s / 3 s
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
