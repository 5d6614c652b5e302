"""metrics.jsonl: one JSON object per trainer step, the keys a step record may hold, and the one
reader of the file.

The coordinator's training loop writes a record per step; `lockgate report` reads the file
after a run and the viewer's dashboard while the run still writes it, both through
`read_metrics`, so a file means the same to all of them.

A record is a flat object: `step`, `version` (the weights the replicas served when it was
written) and metrics in namespaces, one class below per namespace. A step holds only what
happened in it: the `sync/` keys appear on steps that synced, the `val/` keys on the first
record after a validation round ends. `train/` + a name is a trainer metric of the step
(`StepResult.metrics`); `count/` + a `Count` name is a run total since step 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

STEP: Final = "step"
VERSION: Final = "version"
TRAIN_PREFIX: Final = "train/"
COUNT_PREFIX: Final = "count/"


class Reward:
    """The training batch's rewards."""

    MEAN: Final = "reward/mean"
    MIN: Final = "reward/min"
    MAX: Final = "reward/max"


class Batch:
    """What the step trained on."""

    GROUPS: Final = "batch/groups"
    ROLLOUTS: Final = "batch/rollouts"
    SAMPLES: Final = "batch/samples"
    LOSS_TOKENS: Final = "batch/loss_tokens"


class Staleness:
    """How many versions behind the trained weights the batch's tokens were generated."""

    MEAN: Final = "staleness/mean"
    MAX: Final = "staleness/max"
    MIN_VERSION: Final = "staleness/min_version"
    HIST: Final = "staleness/hist"  # {versions behind (a string): tokens}


class Perf:
    GEN_TOKENS_PER_S: Final = "perf/gen_tokens_per_s"
    REPLICA_IDLE_FRAC: Final = "perf/replica_idle_frac"


class Time:
    """Where the step's wall time went, in seconds."""

    STEP_S: Final = "time/step_s"
    WAIT_FOR_GROUPS_S: Final = "time/wait_for_groups_s"
    TRAIN_S: Final = "time/train_s"
    SYNC_S: Final = "time/sync_s"
    SYNC_WAITED_FOR_VAL_S: Final = "time/sync_waited_for_val_s"


class Sync:
    """The weight sync that landed during the step."""

    VERSION: Final = "sync/version"
    DURATION_S: Final = "sync/duration_s"
    STAGE_S: Final = "sync/stage_s"
    PAUSE_LATENCY_S: Final = "sync/pause_latency_s"
    LOAD_S: Final = "sync/load_s"
    RESUME_S: Final = "sync/resume_s"
    INTERRUPTED: Final = "sync/interrupted"
    TOKENS_KEPT: Final = "sync/tokens_kept"


class Val:
    """A validation round: greedy rollouts on held-out tasks with the weights of `VERSION`."""

    VERSION: Final = "val/version"
    REWARD_MEAN: Final = "val/reward_mean"
    REWARD_STD: Final = "val/reward_std"
    REWARD_MIN: Final = "val/reward_min"
    REWARD_MAX: Final = "val/reward_max"
    TASKS: Final = "val/tasks"
    FAILED: Final = "val/failed"
    TIME_S: Final = "val/time_s"


class Count:
    """Names of the run's counters; the loop's state (loop_state.jsonl) keeps them by these
    names, a step record as `count_key(name)`."""

    SYNCS: Final = "syncs"
    ROLLOUTS_FAILED: Final = "rollouts_failed"
    ROLLOUTS_STALE: Final = "rollouts_stale"
    REPLICAS_DROPPED: Final = "replicas_dropped"
    RERENDER_SPLITS: Final = "rerender_splits"
    INTERRUPTED_SEGMENTS: Final = "interrupted_segments"
    INTERRUPTED_TOKENS_KEPT: Final = "interrupted_tokens_kept"
    GROUPS_SCREENED_OUT: Final = "groups_dropped/screened_out"
    GROUPS_DROPPED_STALE: Final = "groups_dropped/stale"
    GROUPS_DROPPED_ZERO_VARIANCE: Final = "groups_dropped/zero_variance"

    @staticmethod
    def groups_dropped(reason: str) -> str:
        """The counter of groups dropped for `reason`."""
        return f"groups_dropped/{reason}"


def count_key(name: str) -> str:
    """A counter's key in a step record."""
    return COUNT_PREFIX + name


class MetricsFileError(ValueError):
    """A line of metrics.jsonl that is not a step record; the message names the file and line."""


def parse_metrics(text: str, source: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl's text, in file order (see `read_metrics`)."""
    lines = text.split("\n")
    # The text after the last newline is a line still being written (empty when none is).
    partial = len(lines) - 1
    records: list[dict[str, Any]] = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if index == partial:
                break  # not yet a record
            raise MetricsFileError(f"{source}:{index + 1}: not valid JSON: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get(STEP), int):
            raise MetricsFileError(f"{source}:{index + 1}: not a step record (no integer 'step')")
        records.append(record)
    return records


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of the metrics.jsonl at `path`, in file order.

    A run may be writing the last line: one with no newline yet that does not parse is skipped,
    since a partial line is not yet a record. Any other line that is not a JSON object with an
    integer `step` raises `MetricsFileError` naming its line number; blank lines are skipped.
    A file that cannot be read raises `OSError`.
    """
    return parse_metrics(path.read_text(errors="replace"), str(path))
