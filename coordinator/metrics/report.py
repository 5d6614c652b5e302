"""`lockgate report`: plots and a one-page HTML summary of a run's metrics.jsonl.

Reading and shaping the metrics (`load_metrics`, `step_series`, `staleness_histogram`,
`summarize`) are pure functions apart from the plotting, which draws with matplotlib's Agg
canvas (no display, no pyplot global state). Several runs make a comparison report whose
reward curves are overlaid per step and per wall-clock minute: per step, fully-async and
synchronous runs look alike; per minute, the overlap of generation and training shows.

A step's wall time is `time/step_s` when the loop logs it, else wait + train + sync.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockgate.coordinator.errors import LockgateError
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import (
    STEP,
    MetricsFileError,
    Perf,
    Reward,
    Staleness,
    Time,
    Val,
    read_metrics,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAN = math.nan


class ReportError(LockgateError):
    """The run dir cannot be reported on; the message is one line for the CLI."""


# ---------------------------------------------------------------------------------------------
# Reading and shaping


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's step records, in file order, as `read_metrics` reads them (a partial last line
    of a run killed mid-write is skipped, any other bad line is an error); a file with no steps
    is an error too.
    """
    if not run_dir.is_dir():
        raise ReportError(f"run dir not found: {run_dir}")
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise ReportError(f"{run_dir} has no {path.name} (is it a run dir?)")
    try:
        records = read_metrics(path)
    except MetricsFileError as exc:
        raise ReportError(str(exc)) from exc
    if not records:
        raise ReportError(f"{path} has no steps yet")
    return records


def _num(record: dict[str, Any], key: str) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else NAN


@dataclass(frozen=True)
class StepSeries:
    """One list entry per step; NaN where a step did not log the metric."""

    steps: list[int]
    reward_mean: list[float]
    reward_min: list[float]
    reward_max: list[float]
    staleness_mean: list[float]
    staleness_max: list[float]
    gen_tokens_per_s: list[float]
    wait_s: list[float]
    train_s: list[float]
    sync_s: list[float]
    step_s: list[float]  # wall time of the step (see the module docstring)
    elapsed_s: list[float]  # wall time from the start of the run to the end of the step
    trainer_idle_frac: list[float]  # 1 - train_s / step_s
    replica_idle_frac: list[float] | None  # None when the run never logged it
    # Validation rounds: (the step whose weights were validated, greedy mean reward).
    validation: list[tuple[int, float]]


def step_series(records: Sequence[dict[str, Any]]) -> StepSeries:
    def column(key: str) -> list[float]:
        return [_num(r, key) for r in records]

    wait, train, sync = (
        column(Time.WAIT_FOR_GROUPS_S),
        column(Time.TRAIN_S),
        column(Time.SYNC_S),
    )
    logged_step = column(Time.STEP_S)
    step_s = [
        logged if not math.isnan(logged) else sum(0.0 if math.isnan(x) else x for x in parts)
        for logged, *parts in zip(logged_step, wait, train, sync, strict=True)
    ]
    elapsed: list[float] = []
    total = 0.0
    for s in step_s:
        total += s
        elapsed.append(total)
    # Idle is everything but training: waiting for groups, for a weight sync, for anything else.
    idle = [
        1.0 - t / s if s > 0 and not math.isnan(t) else NAN
        for t, s in zip(train, step_s, strict=True)
    ]
    replica_idle = column(Perf.REPLICA_IDLE_FRAC)
    return StepSeries(
        steps=[int(r[STEP]) for r in records],
        reward_mean=column(Reward.MEAN),
        reward_min=column(Reward.MIN),
        reward_max=column(Reward.MAX),
        staleness_mean=column(Staleness.MEAN),
        staleness_max=column(Staleness.MAX),
        gen_tokens_per_s=column(Perf.GEN_TOKENS_PER_S),
        wait_s=wait,
        train_s=train,
        sync_s=sync,
        step_s=step_s,
        elapsed_s=elapsed,
        trainer_idle_frac=idle,
        replica_idle_frac=None if all(math.isnan(x) for x in replica_idle) else replica_idle,
        validation=[
            (int(_num(r, Val.VERSION)), _num(r, Val.REWARD_MEAN))
            for r in records
            if not math.isnan(_num(r, Val.VERSION))
        ],
    )


@dataclass(frozen=True)
class StalenessHistogram:
    counts: dict[int, int]  # versions behind -> count
    unit: str  # what is counted: "tokens" (from `staleness/hist`) or "steps"
    source: str  # a caption saying where the counts come from


def staleness_histogram(records: Sequence[dict[str, Any]]) -> StalenessHistogram:
    """Sum the per-step `staleness/hist` dicts when the loop logged them.

    Runs that did not log them get a histogram of steps by their maximum staleness, labelled
    as such, since a per-step mean is not a count.
    """
    with_hist = [r[Staleness.HIST] for r in records if isinstance(r.get(Staleness.HIST), dict)]
    counts: dict[int, int] = {}
    if with_hist:
        for hist in with_hist:
            for key, value in hist.items():
                counts[int(key)] = counts.get(int(key), 0) + int(value)
        partial = (
            ""
            if len(with_hist) == len(records)
            else f" ({len(with_hist)} of {len(records)} steps logged it)"
        )
        return StalenessHistogram(
            dict(sorted(counts.items())), "tokens", f"per-token staleness, all steps{partial}"
        )
    for r in records:
        value = _num(r, Staleness.MAX)
        if not math.isnan(value):
            counts[int(value)] = counts.get(int(value), 0) + 1
    return StalenessHistogram(
        dict(sorted(counts.items())), "steps", "steps by their maximum staleness"
    )


@dataclass(frozen=True)
class ReportSummary:
    name: str
    steps: int
    first_reward: float
    last_reward: float
    best_reward: float
    mean_staleness: float
    max_staleness: float
    total_time_s: float
    gen_tokens_per_s: float  # over the whole run, see run_throughput
    trainer_idle_frac: float  # 1 - total training time over total wall time
    replica_idle_frac: float | None

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, formatted value) pairs, in table order."""
        rows = [
            ("steps", str(self.steps)),
            ("reward, first step", _fmt(self.first_reward)),
            ("reward, last step", _fmt(self.last_reward)),
            ("reward, best step", _fmt(self.best_reward)),
            ("staleness, mean", _fmt(self.mean_staleness, 2)),
            ("staleness, max", _fmt(self.max_staleness, 0)),
            ("total time", _duration(self.total_time_s)),
            ("generated tokens/s", _fmt(self.gen_tokens_per_s, 1)),
            ("trainer idle", _percent(self.trainer_idle_frac)),
        ]
        if self.replica_idle_frac is not None:
            rows.append(("replicas idle", _percent(self.replica_idle_frac)))
        return rows


def _mean(values: Sequence[float]) -> float:
    real = [v for v in values if not math.isnan(v)]
    return sum(real) / len(real) if real else NAN


def _max(values: Sequence[float]) -> float:
    real = [v for v in values if not math.isnan(v)]
    return max(real) if real else NAN


def run_throughput(series: StepSeries) -> float:
    """Generated tokens per second over the whole run: per-step rates weighted by step time.

    The loop counts a group's tokens when the group completes, so single steps swing between
    zero and bursts; the weighted mean is the rate the replicas actually sustained.
    """
    pairs = [
        (rate, s)
        for rate, s in zip(series.gen_tokens_per_s, series.step_s, strict=True)
        if not math.isnan(rate) and s > 0
    ]
    total = sum(s for _, s in pairs)
    return sum(rate * s for rate, s in pairs) / total if total > 0 else NAN


def summarize(name: str, series: StepSeries) -> ReportSummary:
    total = series.elapsed_s[-1] if series.elapsed_s else 0.0
    trained = sum(t for t in series.train_s if not math.isnan(t))
    return ReportSummary(
        name=name,
        steps=len(series.steps),
        first_reward=series.reward_mean[0],
        last_reward=series.reward_mean[-1],
        best_reward=_max(series.reward_mean),
        mean_staleness=_mean(series.staleness_mean),
        max_staleness=_max(series.staleness_max),
        total_time_s=total,
        gen_tokens_per_s=run_throughput(series),
        trainer_idle_frac=1.0 - trained / total if total > 0 else NAN,
        replica_idle_frac=(
            None if series.replica_idle_frac is None else _mean(series.replica_idle_frac)
        ),
    )


def _fmt(value: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def _percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def run_names(run_dirs: Sequence[Path]) -> list[str]:
    """Short, distinct labels: the dir names, or the whole paths where names collide."""
    names = [d.resolve().name or str(d) for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in run_dirs]


# ---------------------------------------------------------------------------------------------
# Plotting

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _figure(rows: int = 1, height: float = 3.6) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(7.5, height * rows), dpi=110, layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _finish_axis(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def plot_reward(series: StepSeries, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    ax.fill_between(
        series.steps,
        series.reward_min,
        series.reward_max,
        color=_COLORS[0],
        alpha=0.18,
        linewidth=0,
        label="min-max over the batch",
    )
    ax.plot(series.steps, series.reward_mean, color=_COLORS[0], marker=".", label="mean")
    if series.validation:
        ax.plot(
            [step for step, _ in series.validation],
            [reward for _, reward in series.validation],
            color=_COLORS[1],
            marker="D",
            label="validation (greedy, held-out)",
        )
    _finish_axis(ax, "Reward per step", "trainer step", "reward")
    # Below the axes: the min-max band usually fills the whole plot, leaving no free corner.
    fig.legend(loc="outside lower center", ncol=3, fontsize=9)
    return _save(fig, path)


def plot_staleness(hist: StalenessHistogram, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    keys = list(hist.counts)
    ax.bar(keys, list(hist.counts.values()), color=_COLORS[0], width=0.7)
    ax.set_xticks(keys)
    _finish_axis(ax, f"Staleness: {hist.source}", "versions behind the trained weights", hist.unit)
    return _save(fig, path)


def plot_throughput(series: StepSeries, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(series.steps, series.gen_tokens_per_s, color=_COLORS[2], marker=".", label="per step")
    overall = run_throughput(series)
    if not math.isnan(overall):
        ax.axhline(
            overall, color="gray", linestyle="--", linewidth=1, label=f"whole run {overall:.0f}"
        )
    _finish_axis(ax, "Generation throughput", "trainer step", "generated tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize=9)
    return _save(fig, path)


def plot_time(series: StepSeries, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    bottom = [0.0] * len(series.steps)
    parts = [
        ("waiting for groups", series.wait_s, "#bbbbbb"),
        ("training", series.train_s, _COLORS[0]),
        ("waiting for a weight sync", series.sync_s, _COLORS[1]),
    ]
    for label, values, color in parts:
        clean = [0.0 if math.isnan(v) else v for v in values]
        ax.bar(series.steps, clean, bottom=bottom, color=color, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, clean, strict=True)]
    other = [max(s - b, 0.0) for s, b in zip(series.step_s, bottom, strict=True)]
    if any(o > 1e-6 for o in other):
        ax.bar(series.steps, other, bottom=bottom, color="#f2d28b", label="other", width=0.8)
    _finish_axis(ax, "Where each step's time went", "trainer step", "seconds")
    ax.legend(loc="best", fontsize=9)
    return _save(fig, path)


def plot_idle(series: StepSeries, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(
        series.steps, series.trainer_idle_frac, color=_COLORS[0], marker=".", label="trainer idle"
    )
    summary = summarize("", series)
    if not math.isnan(summary.trainer_idle_frac):
        ax.axhline(
            summary.trainer_idle_frac,
            color=_COLORS[0],
            linestyle="--",
            linewidth=1,
            label=f"trainer idle, whole run {_percent(summary.trainer_idle_frac)}",
        )
    if series.replica_idle_frac is not None:
        ax.plot(
            series.steps,
            series.replica_idle_frac,
            color=_COLORS[2],
            marker=".",
            label="replicas idle",
        )
    _finish_axis(ax, "Idle fraction (trainer: 1 - training time / step time)", "trainer step", "")
    # Headroom above 100% keeps the legend off the data, which spans the whole range.
    ax.set_ylim(-0.02, 1.3)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.yaxis.set_major_formatter(lambda v, _: f"{100 * v:.0f}%")
    ax.legend(loc="upper center", ncol=3, fontsize=9)
    return _save(fig, path)


def plot_reward_comparison(names: Sequence[str], runs: Sequence[StepSeries], path: Path) -> Path:
    fig = _figure(rows=2)
    by_step, by_time = fig.subplots(2, 1)
    for i, (name, series) in enumerate(zip(names, runs, strict=True)):
        color = _COLORS[i % len(_COLORS)]
        minutes = [t / 60 for t in series.elapsed_s]
        by_step.fill_between(
            series.steps, series.reward_min, series.reward_max, color=color, alpha=0.1, linewidth=0
        )
        by_step.plot(series.steps, series.reward_mean, color=color, marker=".", label=name)
        by_time.plot(minutes, series.reward_mean, color=color, marker=".", label=name)
        if series.validation:
            # Placed at the step whose weights the round validated (its version).
            val_steps, val_rewards = zip(*series.validation, strict=True)
            by_step.plot(
                val_steps, val_rewards, color=color, linestyle="--", marker="s", markersize=4,
                label=f"{name}, greedy validation",
            )  # fmt: skip
    _finish_axis(by_step, "Mean reward per step (band: min-max)", "trainer step", "reward")
    _finish_axis(
        by_time, "Mean reward over wall-clock time", "minutes since the run began", "reward"
    )
    by_step.legend(loc="best", fontsize=9)
    by_time.legend(loc="best", fontsize=9)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class Report:
    html: Path
    images: list[Path]


def _html_page(title: str, table: str, images: Sequence[tuple[str, Path]]) -> str:
    figures = "\n".join(
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>{html.escape(caption)}'
        "</figcaption></figure>"
        for caption, path in images
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 2em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.8em; text-align: right; }}
th {{ background: #f4f4f4; }} td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 0 0 2em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #666; font-size: 0.9em; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{table}
{figures}
</body></html>
"""


def _single_table(summary: ReportSummary) -> str:
    rows = "\n".join(
        f"<tr><td>{html.escape(label)}</td><td>{html.escape(value)}</td></tr>"
        for label, value in summary.rows()
    )
    return f'<table class="summary">\n{rows}\n</table>'


def _comparison_table(summaries: Sequence[ReportSummary]) -> str:
    labels = [label for label, _ in summaries[0].rows()]
    if any(s.replica_idle_frac is not None for s in summaries) and "replicas idle" not in labels:
        labels.append("replicas idle")
    head = "".join(f"<th>{html.escape(s.name)}</th>" for s in summaries)
    body = []
    for label in labels:
        cells = "".join(
            f"<td>{html.escape(dict(s.rows()).get(label, 'n/a'))}</td>" for s in summaries
        )
        body.append(f"<tr><td>{html.escape(label)}</td>{cells}</tr>")
    return f'<table class="summary">\n<tr><th></th>{head}</tr>\n' + "\n".join(body) + "\n</table>"


def write_report(run_dirs: Sequence[Path], out_dir: Path | None = None) -> Report:
    """Write PNGs and report.html for one run (default out: RUN_DIR/report) or compare several.

    Raises `ReportError` for a run dir without usable metrics, and when several runs are given
    without `out_dir`.
    """
    if not run_dirs:
        raise ReportError("no run dir given")
    if len(run_dirs) > 1 and out_dir is None:
        raise ReportError("comparing several runs needs --out DIR")
    records = [load_metrics(d) for d in run_dirs]  # every dir checked before anything is written
    names = run_names(run_dirs)
    series = [step_series(r) for r in records]
    summaries = [summarize(n, s) for n, s in zip(names, series, strict=True)]
    out = out_dir if out_dir is not None else RunDir(run_dirs[0]).report
    out.mkdir(parents=True, exist_ok=True)

    if len(run_dirs) == 1:
        (one,) = series
        hist = staleness_histogram(records[0])
        images = [
            ("Reward: mean per step; band: the batch's min to max", plot_reward(one, out / "reward.png")),
            (f"Staleness: {hist.source}", plot_staleness(hist, out / "staleness.png")),
            ("Generated tokens per second", plot_throughput(one, out / "throughput.png")),
            ("Step time: waiting for groups, training, weight sync", plot_time(one, out / "time.png")),
            ("Idle fractions per step", plot_idle(one, out / "idle.png")),
        ]  # fmt: skip
        page = _html_page(f"lockgate run: {names[0]}", _single_table(summaries[0]), images)
    else:
        images = [
            (
                "Mean reward per step and over wall-clock time",
                plot_reward_comparison(names, series, out / "reward_compare.png"),
            )
        ]
        page = _html_page(
            "lockgate runs: " + " vs ".join(names), _comparison_table(summaries), images
        )
    page_path = out / "report.html"
    page_path.write_text(page)
    return Report(page_path, [path for _, path in images])
