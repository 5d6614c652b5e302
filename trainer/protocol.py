"""The file protocol between the coordinator and the trainer ranks (one run dir, no sockets).

The coordinator writes `batches/step_{k}.json`; every rank reads it. Rank 0 answers with
`results/step_{k}.json`, or `results/step_{k}.error` carrying the traceback. `ready` appears
once every rank holds the model; `STOP` asks the ranks to exit. Every file is written to a
temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

READY = "ready"
STOP = "STOP"


def batch_path(run_dir: Path, step: int) -> Path:
    return run_dir / "batches" / f"step_{step}.json"


def result_path(run_dir: Path, step: int) -> Path:
    return run_dir / "results" / f"step_{step}.json"


def error_path(run_dir: Path, step: int) -> Path:
    return run_dir / "results" / f"step_{step}.error"


def snapshot_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "weights" / f"step_{step}"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
