"""`lockgate report`: shaping metrics into series and summaries, the files it writes, the CLI."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lockgate.coordinator.metrics.report import (
    ReportError,
    load_metrics,
    run_names,
    run_throughput,
    staleness_histogram,
    step_series,
    summarize,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(step: int, **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "step": step,
        "version": step,
        "reward/mean": 0.1 * step,
        "reward/min": 0.0,
        "reward/max": 0.2 * step,
        "staleness/mean": 0.5,
        "staleness/max": step % 2,
        "perf/gen_tokens_per_s": 100.0 * step,
        "time/wait_for_groups_s": 1.0,
        "time/train_s": 2.0,
        "time/sync_s": 1.0,
        "train/loss": -0.01,
    }
    record.update(extra)
    return record


def _run(tmp_path: Path, name: str, records: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# -- shaping ----------------------------------------------------------------------------------


def test_step_series_derives_wall_time_idle_and_elapsed() -> None:
    records = [_record(1), _record(2, **{"time/step_s": 8.0}), _record(3)]
    del records[2]["time/sync_s"]  # a step that did not sync
    s = step_series(records)
    assert s.steps == [1, 2, 3]
    assert s.step_s == [4.0, 8.0, 3.0]  # wait + train + sync unless time/step_s is logged
    assert s.elapsed_s == [4.0, 12.0, 15.0]
    assert s.trainer_idle_frac == [0.5, 0.75, pytest.approx(1 / 3)]  # 1 - train / step
    assert math.isnan(s.sync_s[2])
    assert s.replica_idle_frac is None


def test_replica_idle_is_kept_when_any_step_logged_it() -> None:
    s = step_series([_record(1), _record(2, **{"perf/replica_idle_frac": 0.4})])
    assert s.replica_idle_frac is not None
    assert math.isnan(s.replica_idle_frac[0]) and s.replica_idle_frac[1] == 0.4


def test_staleness_histogram_sums_logged_hists() -> None:
    records = [
        _record(1, **{"staleness/hist": {"0": 10, "1": 2}}),
        _record(2, **{"staleness/hist": {"1": 5, "3": 1}}),
    ]
    hist = staleness_histogram(records)
    assert hist.counts == {0: 10, 1: 7, 3: 1}
    assert hist.unit == "tokens" and "all steps" in hist.source


def test_staleness_histogram_says_when_only_some_steps_logged_one() -> None:
    hist = staleness_histogram([_record(1), _record(2, **{"staleness/hist": {"2": 4}})])
    assert hist.counts == {2: 4} and "1 of 2 steps logged it" in hist.source


def test_staleness_histogram_falls_back_to_steps_by_max_staleness() -> None:
    hist = staleness_histogram(
        [_record(1), _record(2), _record(3), _record(4, **{"staleness/max": 3})]
    )
    assert hist.counts == {0: 1, 1: 2, 3: 1}
    assert hist.unit == "steps"


def test_summary_values() -> None:
    records = [_record(1), _record(2), _record(3, **{"reward/mean": 0.05})]
    summary = summarize("run-a", step_series(records))
    assert summary.steps == 3
    assert summary.first_reward == pytest.approx(0.1)
    assert summary.last_reward == pytest.approx(0.05)
    assert summary.best_reward == pytest.approx(0.2)
    assert summary.mean_staleness == 0.5 and summary.max_staleness == 1
    assert summary.total_time_s == 12.0
    assert summary.trainer_idle_frac == 0.5  # 1 - 6 s trained / 12 s
    assert summary.gen_tokens_per_s == pytest.approx(200.0)  # equal step times: plain mean
    assert dict(summary.rows())["total time"] == "0m12s"
    assert "replicas idle" not in dict(summary.rows())


def test_run_throughput_weights_steps_by_their_wall_time() -> None:
    records = [
        _record(1, **{"perf/gen_tokens_per_s": 0.0, "time/step_s": 1.0}),
        _record(2, **{"perf/gen_tokens_per_s": 100.0, "time/step_s": 3.0}),
    ]
    assert run_throughput(step_series(records)) == 75.0


def test_run_names_fall_back_to_paths_when_names_collide(tmp_path: Path) -> None:
    assert run_names([tmp_path / "a" / "run", tmp_path / "b"]) == ["run", "b"]
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert run_names([a, b]) == [str(a), str(b)]


def test_a_torn_last_line_is_skipped_but_a_bad_middle_line_is_an_error(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, "run", [_record(1), _record(2)])
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')
    assert [r["step"] for r in load_metrics(run_dir)] == [1, 2]
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\nnope\n{"step": 2}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not valid JSON"):
        load_metrics(run_dir)


# -- the files -----------------------------------------------------------------------------------


def test_a_single_run_report_writes_valid_pngs_and_an_html_with_the_summary(
    tmp_path: Path,
) -> None:
    records = [
        _record(i, **{"staleness/hist": {"0": 3, "1": i}, "perf/replica_idle_frac": 0.1})
        for i in range(1, 7)
    ]
    run_dir = _run(tmp_path, "async-run", records)
    report = write_report([run_dir])
    out = run_dir / "report"
    names = {p.name for p in report.images}
    assert names == {"reward.png", "staleness.png", "throughput.png", "time.png", "idle.png"}
    for image in report.images:
        assert image.parent == out
        width, height = _png_size(image)
        assert width >= 600 and height >= 300
        assert image.stat().st_size > 10_000  # axes, lines and labels, not an empty canvas
    page = report.html.read_text()
    assert report.html == out / "report.html"
    assert page.count("data:image/png;base64,") == 5 and 'src="reward.png"' not in page
    for cell in ("async-run", "<td>6</td>", "0.100", "0.600", "0.50", "0m24s", "50.0%", "10.0%"):
        assert cell in page, cell


def test_several_runs_overlay_their_rewards_in_one_comparison(tmp_path: Path) -> None:
    fast = _run(tmp_path, "fully-async", [_record(i) for i in range(1, 5)])
    slow = _run(
        tmp_path,
        "synchronous",
        [_record(i, **{"time/wait_for_groups_s": 6.0}) for i in range(1, 4)],
    )
    report = write_report([fast, slow], tmp_path / "cmp")
    (image,) = report.images
    assert image == tmp_path / "cmp" / "reward_compare.png"
    width, height = _png_size(image)
    assert height > width / 2  # two panels: per step and per wall-clock minute
    page = report.html.read_text()
    assert "<th>fully-async</th><th>synchronous</th>" in page
    assert "<tr><td>steps</td><td>4</td><td>3</td></tr>" in page
    assert "<td>0m16s</td><td>0m27s</td>" in page
    assert not (fast / "report").exists()


def test_several_runs_need_an_out_dir_and_every_dir_is_checked_first(tmp_path: Path) -> None:
    good = _run(tmp_path, "good", [_record(1)])
    with pytest.raises(ReportError, match="--out"):
        write_report([good, good])
    with pytest.raises(ReportError, match="run dir not found"):
        write_report([good, tmp_path / "missing"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the CLI ---------------------------------------------------------------------------------------


def _lockgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_writes_a_report_and_prints_where(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, "run", [_record(1), _record(2)])
    result = _lockgate("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "report" / "report.html")
    assert (run_dir / "report" / "reward.png").is_file()


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("missing", "run dir not found"),
        ("empty", "has no metrics.jsonl"),
        ("no-steps", "has no steps"),
        ("two-runs", "needs --out"),
    ],
)
def test_cli_errors_are_one_line_with_exit_2(tmp_path: Path, setup: str, needle: str) -> None:
    run_dir = tmp_path / "run"
    args = [str(run_dir)]
    if setup == "empty":
        run_dir.mkdir()
    elif setup == "no-steps":
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("\n")
    elif setup == "two-runs":
        _run(tmp_path, "run", [_record(1)])
        args = [str(run_dir), str(run_dir)]
    result = _lockgate("report", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lockgate: ") and needle in lines[0], lines


def test_validation_rounds_are_read_at_the_step_whose_weights_they_validated(
    tmp_path: Path,
) -> None:
    records = [
        _record(1, **{"val/version": 0, "val/reward_mean": 0.25}),
        _record(2),
        _record(3, **{"val/version": 2, "val/reward_mean": 0.5}),
    ]
    assert step_series(records).validation == [(0, 0.25), (2, 0.5)]
    assert step_series([_record(1)]).validation == []
    report = write_report([_run(tmp_path, "val", records)])
    assert report.html.is_file()
