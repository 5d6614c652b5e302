"""The loop's resumable state: one JSON line per trainer step in `RUN_DIR/loop_state.jsonl`.

Tasks are dispatched in a fixed order; the group with serial number s runs task
`tasks[s % len(tasks)]`. Because groups finish (and are trained) out of order, the cursor is
not one number: the line of step k records the next serial to dispatch and the serials that
were dispatched but neither trained nor dropped yet (in flight or buffered), besides the
serials step k trains and those dropped since the previous line.

The line of step k is written before step k's batch goes to the trainer, and its metrics record
before the loop commits step k to the trainer, which checkpoints a step only once committed
(see `lockgate.trainer.protocol`): whenever the trainer holds a checkpoint of step k, both
exist. On `--resume` the loop continues from
the line of the trainer's checkpoint step: the groups pending there are dispatched again
first (their partial rollouts are abandoned, never trained, so no task is skipped or
trained twice), then dispatch goes on from the cursor. Lines and metrics of later steps,
written before the kill, describe work that is redone; they are cut off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from lockgate.gateway.records.metrics_file import STEP, read_metrics


class LoopState(BaseModel):
    step: int = Field(description="The trainer step this line was written for.")
    version: int = Field(description="Weight version the replicas served when it was written.")
    next_serial: int = Field(description="Serial number of the next group to dispatch.")
    pending: list[int] = Field(description="Dispatched serials neither trained nor dropped.")
    trained: list[int] = Field(description="Serials of the groups this step trains.")
    dropped: list[int] = Field(description="Serials dropped since the previous line.")
    counters: dict[str, int] = Field(default_factory=dict)


def append_state(path: Path, state: LoopState) -> None:
    with path.open("a") as f:
        f.write(state.model_dump_json() + "\n")
        f.flush()


def _records(path: Path) -> list[dict[str, Any]]:
    """The file's step records, read as metrics.jsonl is (`read_metrics`): the partial last line
    a killed run leaves is skipped, any other bad line is an error."""
    return read_metrics(path) if path.exists() else []


def load_state(path: Path, step: int) -> LoopState:
    """The line of `step`; `ValueError` when there is none (the run dir is not resumable)."""
    for record in _records(path):
        if record[STEP] == step:
            return LoopState.model_validate(record)
    raise ValueError(f"{path} has no state for step {step}; cannot resume from it")


def truncate_steps(path: Path, last_step: int) -> int:
    """Keep only the JSONL records of steps <= `last_step` (and drop a partial last line).

    Works for `loop_state.jsonl` and `metrics.jsonl` alike; returns the records kept.
    """
    kept = [record for record in _records(path) if record[STEP] <= last_step]
    if path.exists():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(record, sort_keys=True) + "\n" for record in kept))
        tmp.replace(path)
    return len(kept)
