"""What every rank program (RL's `rl/main.py`, SFT's `sft/main.py`) does around its steps: die
with its launcher, restore a checkpoint or clear stale ones, export the model, and say why it
died."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lockgate.trainer import protocol
from lockgate.trainer.checkpoint import clear_checkpoints, latest_checkpoint, load_checkpoint
from lockgate.trainer.config import LoraSpec
from lockgate.trainer.export import write_snapshot
from lockgate.trainer.lora import merge_state_dict, write_adapter
from lockgate.trainer.parallel import Distributed
from lockgate.trainer.protocol import ExportLayout

log = logging.getLogger("lockgate.trainer")
_PR_SET_PDEATHSIG = 1


def export_model(
    model: torch.nn.Module,
    source_dir: Path,
    out: Path,
    world: Distributed,
    layout: ExportLayout | None = None,
    *,
    merge: LoraSpec | None = None,
) -> None:
    """Collective: write the sharded model's full weights as a snapshot at `out` beside
    `source_dir`'s config and tokenizer files (HF layout unless `layout` says otherwise).
    With `merge` (the model's LoRA spec) its adapters are merged into the base weights, so the
    snapshot is a plain HF model."""
    state = full_state_dict(model)
    if world.is_main:
        if merge is not None:
            state = merge_state_dict(state, merge.scaling)
        write_snapshot(state, source_dir, out, layout)


def export_adapter(
    model: torch.nn.Module, spec: LoraSpec, base_dir: Path, out: Path, world: Distributed
) -> None:
    """Collective: write the sharded model's LoRA adapters (only they are gathered) as an
    adapter dir at `out` for the base model in `base_dir` (trainer/lora.py)."""
    state = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )
    if world.is_main:
        write_adapter(state, spec, base_dir, out)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the sharded model's full weights on the CPU, on rank 0 (every rank takes
    part in gathering them; the others get an empty dict)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def restore_or_clear(
    root: Path,
    *,
    resume: bool,
    fresh_from: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world: Distributed,
) -> int:
    """Collective. With `resume`, load the newest checkpoint under `root` and return its step
    (0 when there is none: a fresh start from `fresh_from`); without it, delete the
    checkpoints an earlier run left there and return 0."""
    # Rank 0 looks and tells the others, so all ranks load the same checkpoint.
    found: list[str | None] = [None]
    if world.is_main:
        if resume:
            latest = latest_checkpoint(root)
            found = [str(latest[1]) if latest else None]
            if latest is None:
                log.info("resume: no checkpoint under %s, starting from %s", root, fresh_from)
        elif removed := clear_checkpoints(root):
            log.warning("resume is off: deleted an earlier run's checkpoints %s", removed)
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return 0
    step = load_checkpoint(Path(found[0]), policy, optimizer, world)
    log.info("resumed from %s (step %d)", found[0], step)
    return step


def die_with_launcher() -> None:
    """SIGKILL this rank when torchrun dies.

    torchrun starts each rank in a session of its own, so killing torchrun's process group
    (what a crash of the coordinator or `kill -9` does) would leave the ranks running: still
    polling the run dir, holding memory or a GPU, and answering the next trainer's batches.
    """
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # it died before the signal was armed
        os._exit(1)


def record_failure(path: Path, exc: BaseException) -> None:
    """Say why this rank died in one line, `rank R: ErrorType: message`, for the launcher."""
    rank = os.environ.get("RANK", "0")
    protocol.write_atomic(path, f"rank {rank}: {type(exc).__name__}: {exc}\n")
