"""The file protocol between the coordinator and the trainer ranks (one run dir, no sockets).

The coordinator writes `batches/step_{k}.json`; every rank reads it. Rank 0 answers with
`results/step_{k}.json`, or `results/step_{k}.error` carrying the traceback. `STOP` asks the
ranks to exit. Every file is written to a temporary name and renamed, so a reader never sees
half of one.

`committed` reads "K": the coordinator has durably recorded everything about steps <= K (its
loop state and metrics). A checkpoint due at step k (every `checkpoint_every` steps) is written
only once k is committed, before the trainer takes the next batch; a batch of step k + 1
arriving without that commit, or STOP, skips it. So a checkpoint of step k always has the
coordinator's records of step k beside it, and a run killed between the two resumes from the
previous checkpoint instead of leaving a hole in its metrics.

`failed` reads "rank R: ErrorType: message" when a rank dies of an error outside a step (at
start-up, say: a missing GPU, an unreadable model dir), so the coordinator can say why.

`export_layout.json` (an `ExportLayout`, optional, written by the coordinator) says which
linear weights to store in the replicas' kernel layout; rank 0 reads it at every export, so a
snapshot follows the newest one. Without it snapshots are in HF layout.

With the collective weights transport (`weights: collective` in the trainer's config) a step
writes no snapshot: rank 0 keeps the step's weights in memory, as the bytes of the safetensors
file it would have written, and streams them to the replicas when the coordinator asks, by
writing `sync/send_{k}.json` (a `SendWeights`). Rank 0 answers `sync/sent_{k}.json` (a
`WeightsSent`) or `sync/sent_{k}.error`, from a thread of its own, so a send overlaps the next
step's training. The wire itself is described in trainer/weights_sender.py.

`ready` appears once every rank holds the model. It reads "WORLD_SIZE RESUMED_STEP" (see
`ready_text` / `parse_ready`). RESUMED_STEP is 0 for a fresh start, or N when the trainer was
started with `resume: true` and found its newest checkpoint, `checkpoints/step_N`. Either way
the next batch the trainer waits for is step RESUMED_STEP + 1. A resumed trainer has just
re-exported the checkpoint's weights to `weights/step_N`, so the coordinator can bring the
replicas to version N before it sends step N + 1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

READY = "ready"
STOP = "STOP"
COMMITTED = "committed"
FAILED = "failed"
EXPORT_LAYOUT = "export_layout.json"


def config_path(run_dir: Path) -> Path:
    """The trainer's config (a `TrainerConfig`), written by the coordinator before launch."""
    return run_dir / "config.json"


def batches_dir(run_dir: Path) -> Path:
    return run_dir / "batches"


def results_dir(run_dir: Path) -> Path:
    return run_dir / "results"


def batch_path(run_dir: Path, step: int) -> Path:
    return batches_dir(run_dir) / f"step_{step}.json"


def result_path(run_dir: Path, step: int) -> Path:
    return results_dir(run_dir) / f"step_{step}.json"


def error_path(run_dir: Path, step: int) -> Path:
    return results_dir(run_dir) / f"step_{step}.error"


def snapshots_root(run_dir: Path) -> Path:
    """Where the trainer writes its weight snapshots (the replicas read them there)."""
    return run_dir / "weights"


def snapshot_dir(run_dir: Path, step: int) -> Path:
    return snapshots_root(run_dir) / f"step_{step}"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


class ExportLayout(BaseModel):
    """Linear weights to store in the replicas' kernel layout (trainer/export.py): the
    replica's parameter name -> the checkpoint tensors it joins, in order. Empty: HF layout."""

    model_config = ConfigDict(extra="forbid")
    transposed: dict[str, list[str]] = {}


def export_layout(run_dir: Path) -> ExportLayout | None:
    """The layout snapshots are to be written in; None: HF layout."""
    try:
        return ExportLayout.model_validate_json((run_dir / EXPORT_LAYOUT).read_text())
    except FileNotFoundError:
        return None


# A weights group's id goes into its store keys (gateway/schema.py spells it out too).
GROUP_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class CollectiveGroup(BaseModel):
    """The torch.distributed group the weights travel over: trainer rank 0 (rank 0, hosting
    the group's TCP store at `address`:`port`) and one rank per replica (1 + its place among
    the gateway's replicas). The gateway re-declares it (gateway/schema.py
    `CollectiveWeights`)."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(gt=0)
    join_timeout_s: float | None = Field(default=None, gt=0)  # forming it; None: timeout_s
    # One forming of the group: a new id has every member join afresh (gateway/schema.py).
    group_id: str = Field(default="0", pattern=GROUP_ID_PATTERN)


class SendWeights(BaseModel):
    """The coordinator's request: send step `step`'s weights over `group`."""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0)
    group: CollectiveGroup


class WeightsSent(BaseModel):
    step: int
    bytes: int
    join_s: float  # forming the group (0 once formed)
    send_s: float


def send_request_path(run_dir: Path, step: int) -> Path:
    return run_dir / "sync" / f"send_{step}.json"


def sent_path(run_dir: Path, step: int) -> Path:
    return run_dir / "sync" / f"sent_{step}.json"


def send_error_path(run_dir: Path, step: int) -> Path:
    return run_dir / "sync" / f"sent_{step}.error"


def committed_step(run_dir: Path) -> int:
    """The newest step the coordinator has committed; 0 when it has committed none."""
    try:
        return int((run_dir / COMMITTED).read_text())
    except FileNotFoundError:
        return 0


def ready_text(world_size: int, resumed_step: int) -> str:
    return f"{world_size} {resumed_step}\n"


def parse_ready(text: str) -> tuple[int, int]:
    """(world size, resumed step) from a `ready` file's text."""
    fields = text.split()
    if len(fields) != 2:
        raise ValueError(f"malformed ready file: {text!r} (expected 'WORLD_SIZE RESUMED_STEP')")
    return int(fields[0]), int(fields[1])


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
