"""Step records to TensorBoard and Weights & Biases, besides `metrics.jsonl`.

`metrics.jsonl` stays the source of truth (`lockgate report` reads it); a sink mirrors each
record for live dashboards. Both libraries are optional extras, imported only when configured,
and checked before the run starts anything, so a missing one fails in a second, not after the
replicas have loaded. A sink that fails mid-run is dropped with a warning: losing a dashboard
must not stop training.

Resume: TensorBoard's writer purges the events of the steps that are redone, so its curves
match `metrics.jsonl`. W&B cannot rewrite a run's history offline; the run continues under the
same id, and every chart is plotted against `trainer/step`, so a redone step shows a second
point at the same x rather than being dropped for going back in W&B's own step counter.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from lockgate.coordinator.config import MetricsSection, WandbSection
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import STEP, Staleness

log = logging.getLogger(__name__)

STEP_KEY = "trainer/step"  # W&B's step axis: the sink's own name, not a record's key
_HIST_KEY = Staleness.HIST


class MetricSink(Protocol):
    name: str

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalar_fields(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers, by name, without the step (the x axis) and non-numeric fields."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != STEP and isinstance(v, int | float) and not isinstance(v, bool)
    }


def staleness_buckets(hist: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """(staleness values 0..max, token counts) from a record's `staleness/hist`, gaps as 0."""
    counts = {int(k): int(v) for k, v in hist.items()}
    values = list(range(max(counts, default=0) + 1))
    return values, [counts.get(v, 0) for v in values]


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(
            f"metrics.{extra} is configured but {module} is not installed: "
            f"pip install 'lockgate[{extra}]'"
        ) from exc


def check_sinks(section: MetricsSection) -> None:
    """Fail now, with the install command, when a configured sink's library is missing."""
    if section.tensorboard:
        _require("tensorboardX", "tensorboard")
    if section.wandb is not None:
        _require("wandb", "wandb")


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path, resumed_step: int) -> None:
        tensorboardx = _require("tensorboardX", "tensorboard")
        # purge_step: events of steps after the checkpoint, written before a kill, are hidden;
        # for a fresh start (0) that is every step an earlier run left in a reused run dir.
        self._writer = tensorboardx.SummaryWriter(
            logdir=str(log_dir),
            purge_step=resumed_step + 1,
            # Event files are named by the second they open in; TensorBoard reads them in name
            # order, so a resume within the same second still sorts after the first writer.
            filename_suffix=f".{time.time_ns()}",
        )

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record[STEP])
        for key, value in scalar_fields(record).items():
            self._writer.add_scalar(key, value, step)
        values, counts = staleness_buckets(record.get(_HIST_KEY, {}))
        seen = [v for v, c in zip(values, counts, strict=True) if c]
        if seen:
            self._writer.add_histogram_raw(
                _HIST_KEY,
                min=seen[0],
                max=seen[-1],
                num=sum(counts),
                sum=sum(v * c for v, c in zip(values, counts, strict=True)),
                sum_squares=sum(v * v * c for v, c in zip(values, counts, strict=True)),
                bucket_limits=[v + 0.5 for v in values],
                bucket_counts=counts,
                global_step=step,
            )
        self._writer.flush()  # a dashboard open on a live run sees each step as it lands

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    name = "wandb"

    def __init__(
        self,
        section: WandbSection,
        run_dir: Path,
        run_name: str,
        config: Mapping[str, Any],
        resume: bool,
    ) -> None:
        self._wandb = _require("wandb", "wandb")
        id_file = RunDir(run_dir).wandb_run_id
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        self._run = self._wandb.init(
            project=section.project,
            entity=section.entity,
            name=section.name or run_name,
            group=section.group,
            tags=section.tags,
            mode=section.mode,
            dir=str(run_dir),  # W&B writes its own `wandb/` folder in it
            config=dict(config),
            id=run_id,
            resume="allow" if run_id else None,
            # console="off": W&B must not wrap stderr, where the status line goes.
            settings=self._wandb.Settings(console="off", quiet=True),
        )
        id_file.write_text(self._run.id + "\n")
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def write(self, record: Mapping[str, Any]) -> None:
        data: dict[str, Any] = {STEP_KEY: int(record[STEP]), **scalar_fields(record)}
        values, counts = staleness_buckets(record.get(_HIST_KEY, {}))
        if sum(counts):
            edges = [v - 0.5 for v in values] + [values[-1] + 0.5]
            data[_HIST_KEY] = self._wandb.Histogram(np_histogram=(counts, edges))
        self._run.log(data)

    def close(self) -> None:
        self._run.finish()


def open_sinks(
    section: MetricsSection,
    run_dir: Path,
    run_name: str,
    config: Mapping[str, Any],
    resumed_step: int,
) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if section.tensorboard:
        sinks.append(TensorBoardSink(RunDir(run_dir).tensorboard, resumed_step))
    if section.wandb is not None:
        sinks.append(WandbSink(section.wandb, run_dir, run_name, config, resumed_step > 0))
    return sinks


class SinkFanout:
    """Writes each record to every sink; one that raises is closed, dropped and reported once."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self._sinks = list(sinks)

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in list(self._sinks):
            try:
                sink.write(record)
            except Exception as exc:  # any failure of a dashboard library
                log.warning(
                    "metrics sink %s failed, dropped for the rest of the run: %r", sink.name, exc
                )
                self._sinks.remove(sink)
                self._close(sink)

    def close(self) -> None:
        for sink in self._sinks:
            self._close(sink)
        self._sinks.clear()

    @staticmethod
    def _close(sink: MetricSink) -> None:
        try:
            sink.close()
        except Exception as exc:
            log.warning("closing metrics sink %s failed: %r", sink.name, exc)
