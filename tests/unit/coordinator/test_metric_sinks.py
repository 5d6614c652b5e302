"""TensorBoard and W&B sinks: the files they write load back as the records, resume included."""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from lockgate.coordinator.config import MetricsSection, RunConfig, WandbSection
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.coordinator.metrics.sinks import (
    STEP_KEY,
    TensorBoardSink,
    WandbSink,
    check_sinks,
    scalar_fields,
    staleness_buckets,
)
from tests.support.dashboards import tensorboard_histograms, tensorboard_scalars, wandb_history


def _record(step: int, reward: float) -> dict[str, Any]:
    return {
        "step": step,
        "version": step - 1,
        "reward/mean": reward,
        "count/syncs": step,
        "time/step_s": 1.0,
        "time/train_s": 0.5,
        "time/sync_s": 0.1,
        "perf/gen_tokens_per_s": 100.0,
        "staleness/mean": 0.5,
        "staleness/max": 2,
        "staleness/hist": {"0": 6, "2": 2},
    }


def test_scalars_are_the_numbers_without_step_and_the_histogram_has_no_gaps() -> None:
    fields = scalar_fields({"step": 3, "a/b": 1, "c": 0.5, "flag": True, "hist": {"0": 1}})
    assert fields == {"a/b": 1.0, "c": 0.5}
    assert staleness_buckets({"0": 6, "2": 2}) == ([0, 1, 2], [6, 0, 2])
    assert staleness_buckets({}) == ([0], [0])


def test_tensorboard_events_load_as_the_records_and_a_resume_replaces_redone_steps(
    tmp_path: Path,
) -> None:
    log_dir = tmp_path / "tensorboard"
    first = TensorBoardSink(log_dir, resumed_step=0)
    for step in (1, 2, 3):
        first.write(_record(step, 0.1 * step))
    first.close()
    # Killed after step 3, resumed from the checkpoint of step 2: step 3 is trained again.
    second = TensorBoardSink(log_dir, resumed_step=2)
    for step, reward in ((3, 0.9), (4, 0.8)):
        second.write(_record(step, reward))
    second.close()

    scalars = tensorboard_scalars(log_dir)
    assert scalars["reward/mean"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.9, 4: 0.8})
    assert scalars["count/syncs"] == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert "step" not in scalars
    hist = tensorboard_histograms(log_dir, "staleness/hist")[4]
    assert list(hist.bucket) == [6, 0, 2] and (hist.min, hist.max, hist.num) == (0, 2, 8)

    # A fresh run in the reused run dir: the earlier runs' steps no longer show.
    fresh = TensorBoardSink(log_dir, resumed_step=0)
    fresh.write(_record(1, 0.5))
    fresh.close()
    assert tensorboard_scalars(log_dir)["reward/mean"] == pytest.approx({1: 0.5})


def _wandb_rows(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [row for f in files for row in wandb_history(f)]


def test_wandb_offline_run_logs_every_record_against_the_trainer_step_and_resumes_its_id(
    tmp_path: Path,
) -> None:
    section = WandbSection(project="lockgate-test", mode="offline", tags=["ci"])
    first = WandbSink(section, tmp_path, "toy", {"loop": {"steps": 4}}, resume=False)
    run_id = first._run.id
    for step in (1, 2):
        first.write(_record(step, 0.25 * step))
    first.close()
    # wandb (0.31) names an offline run's folder by the second it starts and the run id: a
    # resumed run started within the same second as the first writes over its file. A real
    # resume restarts the whole run, seconds later at least.
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    second = WandbSink(section, tmp_path, "toy", {"loop": {"steps": 4}}, resume=True)
    assert second._run.id == run_id  # the same W&B run continues
    second.write(_record(2, 0.75))  # redone after the resume: plotted again at x = 2
    second.close()

    # finish() can return before wandb's service has flushed the resumed run's file on a loaded
    # machine (CI once read only the first run's rows), so the rows are read until all arrive.
    deadline = time.monotonic() + 30.0
    while len(rows := _wandb_rows(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    folders = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    logged = [(r[STEP_KEY], r["reward/mean"]) for r in rows]
    assert logged == [(1, 0.25), (2, 0.5), (2, 0.75)], folders
    assert rows[0]["staleness/hist/values"] == [6, 0, 2]
    assert rows[0]["count/syncs"] == 1 and "step" not in rows[0]


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.closed = False

    def write(self, record: Mapping[str, Any]) -> None:
        raise ConnectionError("dashboard unreachable")

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_is_dropped_with_a_warning_and_loses_no_jsonl_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = _Broken()
    log = MetricsLog(tmp_path / "metrics.jsonl", 2, stream=io.StringIO(), sinks=[broken])
    with caplog.at_level(logging.WARNING):
        log.write(_record(1, 0.5))
        log.write(_record(2, 0.5))
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert broken.closed
    assert [r.getMessage() for r in caplog.records if "broken" in r.getMessage()] == [
        "metrics sink broken failed, dropped for the rest of the run: "
        "ConnectionError('dashboard unreachable')"
    ]


def test_a_configured_sink_without_its_library_fails_before_the_run_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    check_sinks(MetricsSection(tensorboard=True))  # installed: fine
    with pytest.raises(RuntimeError, match=r"pip install 'lockgate\[wandb\]'"):
        check_sinks(MetricsSection(wandb=WandbSection()))


def test_the_metrics_section_parses_from_a_config_and_rejects_unknown_modes() -> None:
    config = RunConfig.model_validate(
        {"metrics": {"tensorboard": True, "wandb": {"project": "p", "mode": "offline"}}}
    )
    assert config.metrics.tensorboard and config.metrics.wandb is not None
    assert RunConfig().metrics.wandb is None and not RunConfig().metrics.tensorboard
    with pytest.raises(ValueError, match="mode"):
        RunConfig.model_validate({"metrics": {"wandb": {"mode": "cloud"}}})
