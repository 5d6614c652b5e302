"""The replica side of the `disk` transport's direct load: a vLLM worker extension.

Replicas started with `--worker-extension-cls lockgate.gateway.vllm_ext.snapshot_load.SnapshotLoad`
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

The kernel layout (`lockgate_snapshot_layout`): vLLM-CPU's oneDNN handle build reads the
weight as `weight.t()`, so from a checkpoint's [out, in] rows it reorders a transposed,
strided source, several times the cost of a memcpy of the bytes. Asked which layers it packs
so, the replica names them with their checkpoint tensors; a trainer that then stores each as
one tensor, joined and transposed to [in, out] (snapshot_file.py), hands oneDNN a contiguous
source instead, about half the cost (measured in docs/performance.md and
benchmarks/repack_floor.py).

Staging (`lockgate_stage_snapshot`, opt-in): the handle builds are nearly all of a load's
time, and they need not wait for the pause. Staged in short slices between engine steps (each
RPC builds handles for `budget_s`, then returns so vLLM can run its next step), the new
handles are built beside the serving ones, from the snapshot, on shadow layers. The load
inside the pause then copies the plain parameters and swaps each layer's handle: the pause no
longer grows with the model, at the price of a second copy of the packed weights until the
swap (the CPU work is the same, only moved; docs/design.md "Staging a load"). A staging is
used only by a load of the same files (same path, inode, size and mtime) into the same
layers; anything else drops it and loads in full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockgate.gateway.vllm_ext import moe_experts
from lockgate.gateway.vllm_ext.probe import read_probe
from lockgate.gateway.vllm_ext.snapshot_file import Snapshot, StoredTensor, open_snapshot


class SnapshotMismatch(ValueError):
    """The snapshot does not map onto the model one to one (nothing was changed)."""


@dataclass
class _Source:
    """Where a parameter's new value is in the snapshot."""

    shards: list[StoredTensor]  # its checkpoint tensors, stacked along dim 0 in this order
    rows: list[int]  # each checkpoint tensor's rows
    # One stored tensor holding those checkpoint tensors joined and transposed ([in, out]):
    # what vLLM-CPU's oneDNN handle build reads fastest (snapshot_file.py, "kernel layout").
    kn: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        if self.kn:
            return tuple(reversed(self.shards[0].shape))
        return _rows(self.shards)


@dataclass
class _Copy:
    """A plain parameter takes its stored tensor(s) in place, stacked along dim 0."""

    param: torch.Tensor
    source: _Source
    refresh: nn.Module | None  # a module whose kernel handle is built from this weight


@dataclass
class _Repack:
    """A layer whose weight lives only in a packed kernel handle: rebuilt from the new one."""

    module: nn.Module
    source: _Source
    shape: tuple[int, int]


@dataclass
class _Experts:
    """A stacked expert weight: stored [experts, in, out], served in the kernel's own layout
    (moe_experts.py)."""

    module: nn.Module
    param: torch.Tensor
    stored: StoredTensor


@dataclass
class _Plan:
    copies: list[_Copy]
    repacks: list[_Repack]
    experts: list[_Experts] = field(default_factory=list)


class _Shadow(nn.Module):
    """Stands in for a serving layer while its new handle is built: vLLM's
    `process_weights_after_loading` sets `cpu_linear` and `weight` on it instead."""

    def __init__(self, layer: nn.Module, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = getattr(layer, "bias", None)
        # What the layer's method reads besides the weight (a router's ROCm-only flag included).
        for flag in ("_cpu_skip_gemm_dispatch", "allow_rocm_bf16x3_router_gemm"):
            if hasattr(layer, flag):
                setattr(self, flag, getattr(layer, flag))


# Files of a snapshot as (name, inode, size, mtime): a staging is for these files only.
_Identity = tuple[tuple[str, int, int, int], ...]


def _identity(path: Path) -> _Identity:
    out = []
    for file in sorted(path.glob("*.safetensors")):
        st = file.stat()
        out.append((file.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass
class _Staging:
    path: str
    identity: _Identity
    snap: Snapshot
    plan: _Plan
    built: list[_Shadow] = field(default_factory=list)  # for plan.repacks, in order

    @property
    def done(self) -> bool:
        return len(self.built) == len(self.plan.repacks)

    def close(self) -> None:
        self.built.clear()
        self.snap.close()


def _rows(shards: list[StoredTensor]) -> tuple[int, ...]:
    first = shards[0].shape
    if any(s.shape[1:] != first[1:] for s in shards):
        raise SnapshotMismatch(f"shards of different widths: {[s.shape for s in shards]}")
    return (sum(s.shape[0] for s in shards), *first[1:])


def _group(model: nn.Module, params: dict[str, Any], snap: Snapshot) -> dict[str, _Source]:
    """Where each model parameter's value is stored: its checkpoint tensors (shards of a fused
    layer in vLLM's order), or one tensor in the kernel layout named as the parameter. A
    checkpoint tensor that fits no parameter as named is tried under the model's renaming."""
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    packed = {part: (fused, i) for fused, parts in mapping.items() for i, part in enumerate(parts)}

    def key(name: str) -> tuple[str, int]:
        module_name, _, leaf = name.rpartition(".")
        parent, _, child = module_name.rpartition(".")
        if child in packed:
            fused, index = packed[child]
            return f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}", index
        return name, 0

    groups: dict[str, dict[int, StoredTensor]] = {}
    out: dict[str, _Source] = {}
    for name, stored in snap.tensors.items():
        if name in snap.transposed:
            rows = [r for _, r in snap.transposed[name]]
            if len(stored.shape) != 2 or sum(rows) != stored.shape[1]:
                raise SnapshotMismatch(f"{name}: stored {stored.shape}, its parts' rows {rows}")
            out[name] = _Source([stored], rows, kn=True)
            continue
        target, index = key(name)
        if target not in params:
            target, index = key(moe_experts.vllm_name(model, params, name))
        groups.setdefault(target, {})[index] = stored
    for name, by_index in groups.items():
        if name in out:
            raise SnapshotMismatch(f"{name}: stored both transposed and as checkpoint tensors")
        if sorted(by_index) != list(range(len(by_index))):
            raise SnapshotMismatch(f"{name}: shards {sorted(by_index)} of a fused layer")
        shards = [by_index[i] for i in range(len(by_index))]
        out[name] = _Source(shards, [s.shape[0] for s in shards])
    return out


def _is_packed(module: nn.Module, param: torch.Tensor, leaf: str) -> bool:
    return leaf == "weight" and param.numel() == 0 and hasattr(module, "quant_method")


def plan_load(model: nn.Module, snap: Snapshot) -> _Plan:
    params = dict(model.named_parameters())
    if any(p.is_meta for p in params.values()):
        # A reload_weights that failed part way leaves layers on the meta device with its
        # loaders wrapped around them; only reload_weights can finish that.
        raise SnapshotMismatch("the model is mid-way through a failed reload_weights")
    groups = _group(model, params, snap)
    unknown = sorted(set(groups) - set(params))
    if unknown:
        raise SnapshotMismatch(f"{len(unknown)} stored tensors fit no parameter, e.g. {unknown[0]}")
    missing = sorted(set(params) - set(groups))
    if missing:
        raise SnapshotMismatch(f"{len(missing)} parameters not in the snapshot, e.g. {missing[0]}")
    plan = _Plan([], [])
    for name, source in groups.items():
        param = params[name]
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if any(s.dtype != param.dtype for s in source.shards):
            raise SnapshotMismatch(f"{name}: stored {source.shards[0].dtype}, model {param.dtype}")
        shape = source.shape
        if leaf in moe_experts.EXPERT_WEIGHTS and moe_experts.cpu_experts(module) is not None:
            if len(source.shards) != 1 or source.kn:
                raise SnapshotMismatch(f"{name}: experts stored in {len(source.shards)} parts")
            stored = source.shards[0]
            why = moe_experts.check_experts(module, name, stored.shape, param.shape)
            if why:
                raise SnapshotMismatch(why)
            plan.experts.append(_Experts(module, param, stored))
        elif _is_packed(module, param, leaf):
            # A router (GateLinear) is replicated: its sizes are its layer's.
            want = (
                getattr(module, "output_size_per_partition", None) or module.output_size,
                getattr(module, "input_size_per_partition", None) or module.input_size,
            )
            if getattr(module, "tp_size", 1) != 1 or shape != want:
                raise SnapshotMismatch(f"{name}: stored {shape}, layer {want} (tp 1 only)")
            parts = getattr(module, "output_partition_sizes", None)
            if parts is not None and source.rows != list(parts):
                raise SnapshotMismatch(f"{name}: shards of {source.rows} rows vs {parts}")
            plan.repacks.append(_Repack(module, source, (shape[0], shape[1])))
        elif tuple(param.shape) == shape:
            handle = hasattr(module, "cpu_linear") and leaf == "weight"
            plan.copies.append(_Copy(param, source, module if handle else None))
            if moe_experts.cpu_experts(module) is not None and leaf.endswith("_bias"):
                for held in moe_experts.bias_targets(module, leaf)[1:]:
                    plan.copies.append(_Copy(held, source, None))
        else:
            raise SnapshotMismatch(f"{name}: stored {shape}, model {tuple(param.shape)}")
    return plan


def kernel_layout(model: nn.Module) -> dict[str, list[str]]:
    """The layers whose handle builds a snapshot in the kernel layout speeds up: each packed
    parameter -> the checkpoint tensors it joins, in order (what `_group` maps back)."""
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    out = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not _is_packed(module, param, leaf) or getattr(module, "tp_size", 1) != 1:
            continue
        if not _packs_from_kn(module, param.dtype):
            continue
        parent, _, child = module_name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        out[name] = [f"{prefix}{part}.{leaf}" for part in mapping.get(child, [child])]
    return out


def _packs_from_kn(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether vLLM-CPU builds this layer's handle with oneDNN from `weight.t()`: then a weight
    stored as [in, out] is a contiguous source, which oneDNN reorders into its blocked layout
    at about half the cost of reading [out, in] rows transposed (benchmarks/repack_floor.py).
    The other kernels (AMX bf16, zentorch) are given contiguous [out, in] weights as usual."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
        from vllm.platforms import CpuArchEnum, current_platform
    except ImportError:  # not a vLLM worker
        return False
    if not (current_platform.is_cpu() and ops._supports_onednn) or current_platform.is_zen_cpu():
        return False
    if current_platform.get_cpu_architecture() == CpuArchEnum.POWERPC:
        return False
    n = getattr(module, "output_size_per_partition", None)
    k = getattr(module, "input_size_per_partition", None)
    if n is None or k is None:  # a replicated router (GateLinear): given as [out, in]
        return False
    return not check_cpu_sgl_kernel(n, k, dtype)


class SnapshotLoad:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; `self` is the worker."""

    _lockgate_staging: _Staging | None = None

    def lockgate_snapshot_load_ready(self) -> dict[str, bool]:
        """Answers only where this extension is installed: how the gateway finds out.
        (A dict: vLLM's /collective_rpc passes dicts through and turns other results into
        strings.)"""
        return {"ready": True}

    def lockgate_read_probe(self, path: str) -> dict[str, Any]:
        """What this worker reads in a deploy check's probe file (probe.py): whether it
        shares the trainer's weights volume."""
        return read_probe(path)

    def lockgate_snapshot_layout(self) -> dict[str, Any]:
        """{"transposed": {parameter: [checkpoint tensors]}}: the layers this replica loads
        fastest from a snapshot in the kernel layout (`kernel_layout`)."""
        worker: Any = self
        return {"transposed": kernel_layout(worker.model_runner.get_model())}

    def lockgate_stage_snapshot(self, path: str, budget_s: float = 0.2) -> dict[str, Any]:
        """Build new handles from the snapshot in `path` for about `budget_s`, serving on.

        Call again until "done"; the next `lockgate_load_snapshot(path)` of the same files
        then only swaps them in. Returns {"staged": True, "done", "built", "total",
        "seconds" (this slice's)}, or {"staged": False, "reason"} where the snapshot cannot
        be loaded directly (nothing staged then; the load decides what to do).
        """
        started = time.perf_counter()
        staging = _staging_for(self, path)
        if isinstance(staging, str):
            return {"staged": False, "reason": staging}
        try:
            with torch.no_grad():
                while not staging.done:
                    staging.built.append(
                        _build(staging.plan.repacks[len(staging.built)], staging.snap)
                    )
                    if time.perf_counter() - started >= budget_s:
                        break
        except Exception as exc:  # a layer vLLM cannot rebuild on a shadow: load in full
            self.lockgate_drop_staged()
            return {"staged": False, "reason": f"{type(exc).__name__}: {exc}"}
        return {
            "staged": True,
            "done": staging.done,
            "built": len(staging.built),
            "total": len(staging.plan.repacks),
            "seconds": time.perf_counter() - started,
        }

    def lockgate_drop_staged(self) -> dict[str, bool]:
        """Free a staging (its handles and its snapshot's mapping)."""
        staging = self._lockgate_staging
        self._lockgate_staging = None
        if staging is not None:
            staging.close()
        return {"dropped": staging is not None}

    def lockgate_load_snapshot(self, path: str) -> dict[str, Any]:
        """Load the snapshot in `path` into the running model.

        Returns {"loaded": True, "staged": handles swapped in from a staging, seconds per
        phase}, or {"loaded": False, "reason"} when the snapshot does not map onto the model
        one to one (nothing was changed then).
        """
        worker: Any = self
        runner = worker.model_runner
        started = time.perf_counter()
        staging = _staging_for(self, path)
        if isinstance(staging, str):
            return {"loaded": False, "reason": staging}
        self._lockgate_staging = None
        try:
            plan, built = staging.plan, staging.built
            if built:
                # Planned when staging began: parameters or layers replaced since (a
                # reload_weights in between) must get the weights, not the objects they replaced.
                try:
                    plan = plan_load(runner.get_model(), staging.snap)
                except SnapshotMismatch as exc:
                    return {"loaded": False, "reason": str(exc)}
                if [r.module for r in plan.repacks] != [r.module for r in staging.plan.repacks]:
                    built = []
            staged = len(built)
            planned = time.perf_counter()
            with torch.no_grad():
                _apply_copies(plan, staging.snap)
                copied = time.perf_counter()
                for repack, shadow in zip(plan.repacks, built, strict=False):
                    _swap_in(repack.module, shadow)
                swapped = time.perf_counter()
                # What staging did not get to (all of a plain load): each old handle goes as
                # its new one comes, so the next build reuses its memory.
                for repack in plan.repacks[staged:]:
                    _swap_in(repack.module, _build(repack, staging.snap))
        finally:
            staging.close()
        done = time.perf_counter()
        _reset_caches(runner)
        return {
            "loaded": True,
            "staged": staged,
            "plan_s": planned - started,
            "copy_s": copied - planned,
            "swap_s": swapped - copied,
            "repack_s": done - swapped,
        }


def load_in_place(runner: Any, snap: Snapshot) -> dict[str, float]:
    """Load `snap` (a snapshot on disk or in memory) into the runner's model, as a load with
    nothing staged does: plain parameters copied in place, packed layers rebuilt from it.
    Raises SnapshotMismatch before changing anything where it does not map one to one."""
    started = time.perf_counter()
    plan = plan_load(runner.get_model(), snap)
    planned = time.perf_counter()
    with torch.no_grad():
        _apply_copies(plan, snap)
        copied = time.perf_counter()
        for repack in plan.repacks:
            _swap_in(repack.module, _build(repack, snap))
    _reset_caches(runner)
    return {
        "plan_s": planned - started,
        "copy_s": copied - planned,
        "repack_s": time.perf_counter() - copied,
    }


def _reset_caches(runner: Any) -> None:
    """What vLLM's own reload_weights invalidates after a load."""
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()


def _staging_for(ext: SnapshotLoad, path: str) -> _Staging | str:
    """The staging of the snapshot in `path`: the current one if it is of these very files,
    else a new one (the current one dropped); or why the snapshot cannot load directly.
    (A function, not a method: vLLM offers every method of the extension as an RPC.)"""
    worker: Any = ext
    current = ext._lockgate_staging
    try:
        identity = _identity(Path(path))
    except OSError as exc:
        ext.lockgate_drop_staged()
        return f"{type(exc).__name__}: {exc}"
    if current is not None and current.path == path and current.identity == identity:
        return current
    ext.lockgate_drop_staged()
    try:
        snap = open_snapshot(Path(path))
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        plan = plan_load(worker.model_runner.get_model(), snap)
    except SnapshotMismatch as exc:
        snap.close()
        return str(exc)
    ext._lockgate_staging = _Staging(path, identity, snap, plan)
    return ext._lockgate_staging


def _apply_copies(plan: _Plan, snap: Snapshot) -> None:
    for experts in plan.experts:
        moe_experts.load_experts(experts.module, experts.param, snap.read(experts.stored))
    for copy in plan.copies:
        source = copy.source
        if source.kn:
            copy.param.copy_(snap.read(source.shards[0]).t())
        else:
            row = 0
            for shard in source.shards:
                copy.param[row : row + shard.shape[0]].copy_(snap.read(shard))
                row += shard.shape[0]
        if copy.refresh is not None:
            copy.refresh.quant_method.process_weights_after_loading(copy.refresh)


def _weight(repack: _Repack, snap: Snapshot) -> torch.Tensor:
    """The layer's new [out, in] weight, without a copy where the file allows."""
    source = repack.source
    first, last = source.shards[0], source.shards[-1]
    if source.kn:
        weight = snap.read(first).t()  # vLLM's build reads it back as .t(): contiguous [in, out]
        if not _packs_from_kn(repack.module, first.dtype):
            weight = weight.contiguous()
        return weight
    if snap.adjacent(source.shards):
        return snap.view(first, last.end, repack.shape)
    # Joined in a buffer kept across loads: memory touched once is not faulted in again.
    key = (repack.shape, first.dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(repack.shape, dtype=first.dtype)
    torch.cat([snap.read(s) for s in source.shards], out=_SCRATCH[key])
    return _SCRATCH[key]


def _build(repack: _Repack, snap: Snapshot) -> _Shadow:
    """The layer's new handle, built on a shadow of it from the snapshot's weight."""
    weight = _weight(repack, snap)
    shadow = _Shadow(repack.module, weight)
    repack.module.quant_method.process_weights_after_loading(shadow)
    if shadow.weight.numel():
        # The layer kept the weight it was given; it must not point into the snapshot's
        # pages (unmapped after this load) nor into the shared buffer.
        shadow.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return shadow


def _swap_in(module: nn.Module, shadow: _Shadow) -> None:
    """What vLLM-CPU's handle build leaves on a layer: its kernel and its (emptied) weight."""
    if hasattr(shadow, "cpu_linear"):
        module.cpu_linear = shadow.cpu_linear
    module.weight = shadow.weight
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


# Per worker process: q/k/v are joined here for each build, one layer at a time.
_SCRATCH: dict[tuple[tuple[int, int], torch.dtype], torch.Tensor] = {}
