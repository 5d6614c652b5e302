"""Trainer checkpoints with torch.distributed.checkpoint (DCP): resumable, and reshardable.

`checkpoints/step_N/` holds DCP's files for the model and optimizer (sharded DTensor state, so
each rank writes its own shard and a different world size can load it), one `rng_rank{r}.pt`
per rank and `meta.json` with the step. Every rank writes into `.step_N.tmp`; once all are done
rank 0 adds `meta.json` and renames the folder, so a `step_N` folder is always complete and a
crash mid-save leaves only a temp folder, which the next save of that step replaces.

The learning-rate schedule is a pure function of the step (`schedule.py`), so the step is the
scheduler's whole state.

With LoRA the base weights are frozen and come from the model dir at every start: a checkpoint
holds only the trainable parameters (the adapters) and their optimizer state.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from lockgate.trainer.parallel import Distributed

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_META = "meta.json"


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first (temp folders and strays are ignored)."""
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / _META).is_file()
    )


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for _, path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def clear_checkpoints(root: Path) -> list[str]:
    """Delete every checkpoint and temp folder under `root`; returns the deleted names.

    A fresh run in a reused run dir must not leave an earlier run's newer checkpoints behind,
    or a later resume would pick them up.
    """
    if not root.is_dir():
        return []
    removed = []
    for p in root.iterdir():
        if p.is_dir() and (_STEP_DIR.match(p.name) or p.name.endswith(".tmp")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return sorted(removed)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _alone(world: Distributed) -> bool:
    """One rank saves and loads without DCP's collectives. Through gloo they gather the pickled
    plans, and gloo copies tensors that large on a thread of its own with an OpenMP team of its
    own: libgomp then manages more threads than there are cores and stops the trainer's idle
    threads spinning for the rest of the process, which slows a small model's steps from the
    first checkpoint on (measured in docs/performance.md, "Trainer")."""
    return world.world_size == 1


@contextmanager
def _quiet_alone() -> Iterator[None]:
    """DCP warns at every one-rank save and load that it assumes a single process: intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(model: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (a LoRA model's base) are neither saved nor expected on load."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world: Distributed,
    *,
    keep: int,
) -> Path:
    """Collective: every rank calls it. Returns the finished `step_N` folder."""
    final = checkpoint_path(root, step)
    tmp = root / f".{final.name}.tmp"
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    with _quiet_alone():
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=tmp,
            no_dist=_alone(world),
        )
    torch.save(_rng_state(), tmp / f"rng_rank{world.rank}.pt")
    dist.barrier()
    if world.is_main:
        (tmp / _META).write_text(json.dumps({"step": step, "world_size": world.world_size}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune_checkpoints(root, keep)
    # Nobody goes on (and maybe reads the folder) before it is in place.
    dist.barrier()
    return final


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Distributed
) -> int:
    """Collective: restore model, optimizer and this rank's RNG from `path`; returns its step."""
    meta = json.loads((path / _META).read_text())
    options = _options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    with _quiet_alone():
        dcp.load(state, checkpoint_id=path, no_dist=_alone(world))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )
    rng = path / f"rng_rank{world.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    else:
        # Saved by a smaller world: the weights reshard, but this rank's RNG stream is new.
        log.warning("%s has no RNG state for rank %d; keeping the seeded one", path, world.rank)
    return int(meta["step"])
