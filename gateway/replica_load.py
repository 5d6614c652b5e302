"""The replica side of the `disk` transport's direct load: a vLLM worker extension.

Replicas started with `--worker-extension-cls lockgate.gateway.replica_load.SnapshotLoad`
answer `POST /collective_rpc {"method": "lockgate_load_snapshot", "args": [DIR]}`.

Why not vLLM's `reload_weights`: on CPU it moves every layer back to the meta device,
materializes fresh tensors, runs the checkpoint weight loaders into them, repacks each linear
layer into a oneDNN handle and copies the results back: several passes over freshly
allocated memory around the repack, and fresh memory costs a page fault per 4 KiB. Here each
tensor is read once, from the snapshot's pages (the trainer just wrote them, so they are in
the page cache): plain parameters (norms, embeddings) are copied in place, and a linear layer
whose weight vLLM-CPU keeps only inside its packed handle gets the new weight as a view of
the file (adjacent shards such as gate_proj + up_proj are one view; others are joined in a
buffer kept for the next load) and vLLM's own `process_weights_after_loading` builds the new
handle from it, exactly as at start-up. Calling `model.load_weights()` instead fails on CPU
because those weights are empty once packed (shape (0,)).

It loads only what it can prove complete: every tensor of the snapshot must land on a
parameter of the model with the same dtype and shape, and every parameter must be covered.
Otherwise it raises before changing anything, and the gateway falls back to `reload_weights`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockgate.gateway.snapshot_file import Snapshot, StoredTensor, open_snapshot


class SnapshotMismatch(ValueError):
    """The snapshot does not map onto the model one to one (nothing was changed)."""


@dataclass
class _Copy:
    """A plain parameter takes its stored tensor(s) in place, stacked along dim 0."""

    param: torch.Tensor
    shards: list[StoredTensor]
    refresh: nn.Module | None  # a module whose kernel handle is built from this weight


@dataclass
class _Repack:
    """A layer whose weight lives only in a packed kernel handle: rebuilt from the new one."""

    module: nn.Module
    shards: list[StoredTensor]
    shape: tuple[int, int]


@dataclass
class _Plan:
    copies: list[_Copy]
    repacks: list[_Repack]


def _rows(shards: list[StoredTensor]) -> tuple[int, ...]:
    first = shards[0].shape
    if any(s.shape[1:] != first[1:] for s in shards):
        raise SnapshotMismatch(f"shards of different widths: {[s.shape for s in shards]}")
    return (sum(s.shape[0] for s in shards), *first[1:])


def _group(model: nn.Module, snap: Snapshot) -> dict[str, list[StoredTensor]]:
    """Stored tensors per model parameter name, shards of a fused layer in their order."""
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    packed = {part: (fused, i) for fused, parts in mapping.items() for i, part in enumerate(parts)}
    groups: dict[str, dict[int, StoredTensor]] = {}
    for name, stored in snap.tensors.items():
        module_name, _, leaf = name.rpartition(".")
        parent, _, child = module_name.rpartition(".")
        index = 0
        if child in packed:
            fused, index = packed[child]
            module_name = f"{parent}.{fused}" if parent else fused
        groups.setdefault(f"{module_name}.{leaf}", {})[index] = stored
    out = {}
    for name, by_index in groups.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise SnapshotMismatch(f"{name}: shards {sorted(by_index)} of a fused layer")
        out[name] = [by_index[i] for i in range(len(by_index))]
    return out


def _is_packed(module: nn.Module, param: torch.Tensor, leaf: str) -> bool:
    return leaf == "weight" and param.numel() == 0 and hasattr(module, "quant_method")


def plan_load(model: nn.Module, snap: Snapshot) -> _Plan:
    params = dict(model.named_parameters())
    if any(p.is_meta for p in params.values()):
        # A reload_weights that failed part way leaves layers on the meta device with its
        # loaders wrapped around them; only reload_weights can finish that.
        raise SnapshotMismatch("the model is mid-way through a failed reload_weights")
    groups = _group(model, snap)
    unknown = sorted(set(groups) - set(params))
    if unknown:
        raise SnapshotMismatch(f"{len(unknown)} stored tensors fit no parameter, e.g. {unknown[0]}")
    missing = sorted(set(params) - set(groups))
    if missing:
        raise SnapshotMismatch(f"{len(missing)} parameters not in the snapshot, e.g. {missing[0]}")
    plan = _Plan([], [])
    for name, shards in groups.items():
        param = params[name]
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if any(s.dtype != param.dtype for s in shards):
            raise SnapshotMismatch(f"{name}: stored {shards[0].dtype}, model {param.dtype}")
        shape = _rows(shards)
        if _is_packed(module, param, leaf):
            want = (module.output_size_per_partition, module.input_size_per_partition)
            if getattr(module, "tp_size", 1) != 1 or shape != want:
                raise SnapshotMismatch(f"{name}: stored {shape}, layer {want} (tp 1 only)")
            parts = getattr(module, "output_partition_sizes", None)
            if parts is not None and [s.shape[0] for s in shards] != list(parts):
                raise SnapshotMismatch(f"{name}: shards {[s.shape for s in shards]} vs {parts}")
            plan.repacks.append(_Repack(module, shards, (shape[0], shape[1])))
        elif tuple(param.shape) == shape:
            handle = hasattr(module, "cpu_linear") and leaf == "weight"
            plan.copies.append(_Copy(param, shards, module if handle else None))
        else:
            raise SnapshotMismatch(f"{name}: stored {shape}, model {tuple(param.shape)}")
    return plan


class SnapshotLoad:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; `self` is the worker."""

    def lockgate_snapshot_load_ready(self) -> dict[str, bool]:
        """Answers only where this extension is installed: how the gateway finds out.
        (A dict: vLLM's /collective_rpc passes dicts through and turns other results into
        strings.)"""
        return {"ready": True}

    def lockgate_load_snapshot(self, path: str) -> dict[str, Any]:
        """Load the snapshot in `path` into the running model.

        Returns {"loaded": True, seconds per phase}, or {"loaded": False, "reason"} when the
        snapshot does not map onto the model one to one (nothing was changed then).
        """
        worker: Any = self
        runner = worker.model_runner
        started = time.perf_counter()
        try:
            snap = open_snapshot(Path(path))
        except (OSError, ValueError) as exc:
            return {"loaded": False, "reason": f"{type(exc).__name__}: {exc}"}
        try:
            try:
                plan = plan_load(runner.get_model(), snap)
            except SnapshotMismatch as exc:
                return {"loaded": False, "reason": str(exc)}
            planned = time.perf_counter()
            with torch.no_grad():
                _apply_copies(plan, snap)
                copied = time.perf_counter()
                _apply_repacks(plan, snap, self._scratch())
        finally:
            snap.close()
        done = time.perf_counter()
        # What vLLM's own reload_weights invalidates after a load.
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return {
            "loaded": True,
            "plan_s": planned - started,
            "copy_s": copied - planned,
            "repack_s": done - copied,
        }

    def _scratch(self) -> dict[tuple[tuple[int, int], torch.dtype], torch.Tensor]:
        # Kept across loads: memory touched once is not faulted in again on the next load.
        if not hasattr(self, "_lockgate_scratch"):
            self._lockgate_scratch: dict[tuple[tuple[int, int], torch.dtype], torch.Tensor] = {}
        return self._lockgate_scratch


def _apply_copies(plan: _Plan, snap: Snapshot) -> None:
    for copy in plan.copies:
        row = 0
        for shard in copy.shards:
            copy.param[row : row + shard.shape[0]].copy_(snap.read(shard))
            row += shard.shape[0]
        if copy.refresh is not None:
            copy.refresh.quant_method.process_weights_after_loading(copy.refresh)


def _apply_repacks(
    plan: _Plan,
    snap: Snapshot,
    scratch: dict[tuple[tuple[int, int], torch.dtype], torch.Tensor],
) -> None:
    for repack in plan.repacks:
        first, last = repack.shards[0], repack.shards[-1]
        if snap.adjacent(repack.shards):
            weight = snap.view(first, last.end, repack.shape)
        else:
            key = (repack.shape, first.dtype)
            if key not in scratch:
                scratch[key] = torch.empty(repack.shape, dtype=first.dtype)
            weight = scratch[key]
            torch.cat([snap.read(s) for s in repack.shards], out=weight)
        module = repack.module
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.quant_method.process_weights_after_loading(module)
        if module.weight.numel():
            # The layer kept the weight it was given; it must not point into the snapshot's
            # pages (unmapped after this load) nor into the shared buffer.
            module.weight = nn.Parameter(weight.clone(), requires_grad=False)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
