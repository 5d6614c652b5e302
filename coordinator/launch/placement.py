"""Where a run's replicas and trainer ranks go on this node's GPUs: the devices each part runs
on, and for CUDA the GPUs each local replica and trainer rank gets (their CUDA_VISIBLE_DEVICES).

`plan_gpus` is pure (the GPUs, their memory and the model's size are its arguments) and raises a
one-line `DeployError` naming the option at fault; `placement_here` reads them on this machine.

The automatic split gives the replicas the first GPUs and the trainer ranks the next ones:
replica i takes GPUs [i*T, (i+1)*T) for tensor_parallel_size T, so every tensor-parallel group
starts at a multiple of T, as GPU pairs and quads sharing a bridge or a PCIe switch are laid
out; the trainer's ranks need no such alignment (FSDP gathers across all of them).

Sharing a GPU (`replicas.colocate`, or automatically with one GPU): each shared GPU holds one
replica (or one tensor-parallel shard of it) and one trainer rank, so replicas.count x T must
equal trainer.world_size. The replica is given the GPU memory the trainer rank leaves:

    trainer rank bytes  = P x 16 / W + margin
    gpu_memory_utilization = floor_0.01(1 - trainer rank bytes / GPU bytes)

with P the model's parameter count, 16 bytes per parameter for what FSDP shards over the W
ranks (fp32 master weight 4, fp32 gradient 4, Adam's two fp32 moments 8), and the margin
(`replicas.colocate_margin_gib`) for activations, gathered layers, the CUDA context and NCCL's
buffers. It fits when that fraction of the GPU still holds the replica's bf16 weights
(P x 2 / T) and `MIN_KV_CACHE_BYTES` of KV cache. The replicas start (and take their fraction)
before the trainer ranks allocate, which is what vLLM's start-up check of free memory needs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.deploy_checks import DeployError

LaunchDevice = Literal["cpu", "cuda"]

# fp32 master weight, fp32 gradient and Adam's two fp32 moments, all sharded by FSDP.
TRAINED_BYTES_PER_PARAM = 16
# The replicas serve in bf16 on CUDA.
SERVED_BYTES_PER_PARAM = 2
# The least KV cache a replica is worth starting with.
MIN_KV_CACHE_BYTES = 1 << 30
# vLLM's own default, used where a replica has its GPUs to itself.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_GIB = 1 << 30


@dataclass(frozen=True)
class GpuRequest:
    """What the GPU plan is asked: `replicas` x `tensor_parallel_size` GPUs for the replicas
    and one per trainer rank (`trainer_ranks`; 0 where that part is not on CUDA here)."""

    visible: Sequence[str]  # CUDA ids of the GPUs this process may use, in order
    gpu_bytes: int  # memory of the smallest of them
    replicas: int
    tensor_parallel_size: int
    trainer_ranks: int
    param_count: int
    replica_gpus: Sequence[int] | None = None  # indices into `visible`
    trainer_gpus: Sequence[int] | None = None
    colocate: bool | None = None
    gpu_memory_utilization: float | None = None
    margin_bytes: int = 4 * _GIB


@dataclass(frozen=True)
class GpuPlan:
    """Each local replica's GPUs, the trainer ranks' GPUs (LOCAL_RANK r takes the r-th), and
    the replicas' share of their GPUs' memory."""

    replica_gpus: list[list[str]]
    trainer_gpus: list[str]
    gpu_memory_utilization: float
    colocated: bool
    unused: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The plan as printed at start."""
        out = [
            f"replica {i}: GPU {','.join(gpus)} (gpu_memory_utilization "
            f"{self.gpu_memory_utilization:g})"
            for i, gpus in enumerate(self.replica_gpus)
        ]
        shared = " (shared with the replicas)" if self.colocated else ""
        out += [f"trainer rank {r}: GPU {gpu}{shared}" for r, gpu in enumerate(self.trainer_gpus)]
        if self.unused:
            out.append(f"unused: GPU {','.join(self.unused)}")
        return out


@dataclass(frozen=True)
class Placement:
    """The devices the run's replicas and trainer ranks run on, and their GPUs on this node
    (None: no part is on CUDA here, or Ray assigns the GPUs)."""

    replica_device: LaunchDevice
    trainer_device: LaunchDevice
    gpus: GpuPlan | None = None


CPU_ONLY = Placement("cpu", "cpu")


def placement_lines(placement: Placement) -> list[str]:
    """What is printed at start: nothing when every part runs on CPUs, else the devices and
    the GPU plan."""
    if placement == CPU_ONLY:
        return []
    head = (
        f"placement: replicas on {placement.replica_device}, trainer on {placement.trainer_device}"
    )
    plan = placement.gpus
    return [head, *(f"  {line}" for line in (plan.lines() if plan is not None else []))]


def trainer_gpus(placement: Placement) -> list[str] | None:
    """The trainer ranks' CUDA_VISIBLE_DEVICES on this node; None: leave the environment's."""
    if placement.trainer_device != "cuda" or placement.gpus is None:
        return None
    return placement.gpus.trainer_gpus


def placement_on_cluster(config: RunConfig, cluster_gpus: float) -> Placement:
    """The devices of the run's parts on a Ray cluster that declares `cluster_gpus` GPUs; Ray
    assigns each bundle's GPUs, so there is no plan of GPU ids."""
    gpus = math.ceil(cluster_gpus)
    return Placement(
        resolve_device(config.replicas.device, gpus, serves=True),
        resolve_device(config.trainer.device, gpus),
    )


def _checked_indices(given: Sequence[int], need: int, count: int, option: str) -> list[int]:
    if len(given) != need:
        raise DeployError(f"{option}: lists {len(given)} GPUs, but {need} are needed")
    outside = [i for i in given if not 0 <= i < count]
    if outside:
        raise DeployError(f"{option}: GPU {outside[0]} is not among the {count} visible")
    if len(set(given)) != len(given):
        raise DeployError(f"{option}: lists a GPU twice")
    return list(given)


def _first_free(count: int, taken: Sequence[int], need: int) -> list[int]:
    return [i for i in range(count) if i not in taken][:need]


def colocated_utilization(r: GpuRequest) -> float:
    """The replicas' gpu_memory_utilization on GPUs each shared with one trainer rank (the
    module's formula); a `DeployError` when the two do not fit."""
    trainer = r.param_count * TRAINED_BYTES_PER_PARAM / r.trainer_ranks + r.margin_bytes
    most = math.floor((1.0 - trainer / r.gpu_bytes) * 100) / 100
    replica = r.param_count * SERVED_BYTES_PER_PARAM / r.tensor_parallel_size
    if most * r.gpu_bytes < replica + MIN_KV_CACHE_BYTES:
        raise DeployError(
            f"replicas.colocate: a trainer rank ({trainer / _GIB:.1f} GiB: {r.param_count:,} "
            f"params x {TRAINED_BYTES_PER_PARAM} B / {r.trainer_ranks} ranks + margin) and a "
            f"replica ({replica / _GIB:.1f} GiB of weights + {MIN_KV_CACHE_BYTES / _GIB:g} GiB "
            f"KV cache) do not fit on one {r.gpu_bytes / _GIB:.1f} GiB GPU: use more GPUs "
            "without colocation, more trainer ranks, or a smaller model"
        )
    if r.gpu_memory_utilization is not None:
        if r.gpu_memory_utilization > most:
            raise DeployError(
                f"replicas.gpu_memory_utilization: {r.gpu_memory_utilization:g} leaves the "
                f"trainer rank sharing the GPU less than its {trainer / _GIB:.1f} GiB "
                f"(at most {most:g} fits)"
            )
        return r.gpu_memory_utilization
    return most


def _colocated(r: GpuRequest) -> GpuPlan:
    g, shards = len(r.visible), r.replicas * r.tensor_parallel_size
    if shards != r.trainer_ranks:
        raise DeployError(
            f"replicas.colocate: each shared GPU holds one replica shard and one trainer rank, "
            f"so replicas.count x tensor_parallel_size ({shards}) must equal trainer.world_size "
            f"({r.trainer_ranks})"
        )
    if shards > g:
        raise DeployError(f"replicas.colocate: {shards} shared GPUs needed, {g} visible")
    given = r.replica_gpus if r.replica_gpus is not None else r.trainer_gpus
    if given is None:
        shared = list(range(shards))
    else:
        shared = _checked_indices(given, shards, g, "replicas.gpus")
    trainer = shared
    if r.trainer_gpus is not None:
        trainer = _checked_indices(r.trainer_gpus, shards, g, "trainer.gpus")
        if sorted(trainer) != sorted(shared):
            raise DeployError(
                "replicas.colocate: replicas.gpus and trainer.gpus must be the same GPUs"
            )
    return _plan(r, shared, trainer, colocated_utilization(r), colocated=True)


def _separate(r: GpuRequest) -> GpuPlan:
    g, shards, ranks = len(r.visible), r.replicas * r.tensor_parallel_size, r.trainer_ranks
    if r.replica_gpus is None and r.trainer_gpus is None and shards + ranks > g:
        share = ", or share GPUs with replicas.colocate: true" if shards and ranks else ""
        raise DeployError(
            f"replicas.count: {r.replicas} replicas x tensor_parallel_size "
            f"{r.tensor_parallel_size} + {ranks} trainer ranks need {shards + ranks} GPUs, "
            f"{g} visible: ask for fewer{share}"
        )
    replicas = trainer = None
    if r.replica_gpus is not None:
        replicas = _checked_indices(r.replica_gpus, shards, g, "replicas.gpus")
    if r.trainer_gpus is not None:
        trainer = _checked_indices(r.trainer_gpus, ranks, g, "trainer.gpus")
    if replicas is None:
        replicas = _first_free(g, trainer or [], shards)
    if trainer is None:
        trainer = _first_free(g, replicas, ranks)
    if len(replicas) < shards or len(trainer) < ranks:
        raise DeployError(
            f"replicas.gpus / trainer.gpus: {shards + ranks} GPUs needed, {g} visible"
        )
    both = sorted(set(replicas) & set(trainer))
    if both:
        raise DeployError(
            f"trainer.gpus: GPU {both[0]} is in replicas.gpus too; parts get disjoint GPUs "
            "unless replicas.colocate: true shares them (with the memory split)"
        )
    utilization = r.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    return _plan(r, replicas, trainer, utilization, colocated=False)


def _plan(
    r: GpuRequest, replicas: list[int], trainer: list[int], utilization: float, *, colocated: bool
) -> GpuPlan:
    t = r.tensor_parallel_size
    ids = list(r.visible)
    return GpuPlan(
        replica_gpus=[[ids[i] for i in replicas[k * t : (k + 1) * t]] for k in range(r.replicas)],
        trainer_gpus=[ids[i] for i in trainer],
        gpu_memory_utilization=utilization,
        colocated=colocated,
        unused=[ids[i] for i in range(len(ids)) if i not in replicas and i not in trainer],
    )


def plan_gpus(r: GpuRequest) -> GpuPlan:
    """Disjoint GPUs for the replicas and the trainer ranks, or shared ones with the memory
    split of the module's formula (`colocate`; unset: with one GPU and both parts on it)."""
    if not r.visible:
        raise DeployError("replicas.device / trainer.device: cuda asked, but no GPU is visible")
    both = r.replicas > 0 and r.trainer_ranks > 0
    colocate = r.colocate if r.colocate is not None else (len(r.visible) == 1 and both)
    return _colocated(r) if colocate and both else _separate(r)


def resolve_device(asked: str, gpus: int, *, serves: bool = False) -> LaunchDevice:
    """`auto`: cuda where a GPU is visible (and, for the replicas, `serves`, the installed vLLM
    is not the CPU build, which cannot use one), else cpu."""
    if asked == "cpu":
        return "cpu"
    if asked == "cuda":
        return "cuda"
    return "cuda" if gpus > 0 and not (serves and _vllm_cpu_build()) else "cpu"


def _vllm_cpu_build() -> bool:
    from lockgate.coordinator.launch.replicas import vllm_is_cpu_build

    return vllm_is_cpu_build()


def visible_gpus() -> list[str]:
    """The CUDA ids of the GPUs this process may use (its CUDA_VISIBLE_DEVICES, or all that
    torch counts): a child's CUDA_VISIBLE_DEVICES must name these, not indices into them.
    Without NVIDIA's driver (no /dev/nvidia0 ...) there is none, and torch is not loaded."""
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/proc/driver/nvidia").exists():
        return []
    import torch  # here: loading it costs a CPU run's coordinator seconds for nothing

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def smallest_gpu_bytes(count: int) -> int:
    import torch

    return min(torch.cuda.get_device_properties(i).total_memory for i in range(count))


def param_count(model_dir: Path) -> int:
    """The model's parameter count, from its safetensors headers (no tensor is read)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def placement_here(
    config: RunConfig, model_dir: Path, *, replicas_here: int, trainer_ranks: int
) -> Placement:
    """The run's placement on this node: `replicas_here` local replicas (0: they run
    elsewhere) and `trainer_ranks` local ranks, on the devices their sections ask for."""
    section, trainer = config.replicas, config.trainer
    asked = [section.device if replicas_here else "cpu", trainer.device if trainer_ranks else "cpu"]
    if all(a == "cpu" for a in asked):
        return CPU_ONLY
    ids = visible_gpus()
    replica_device = resolve_device(asked[0], len(ids), serves=True)
    trainer_device = resolve_device(asked[1], len(ids))
    if replica_device == trainer_device == "cpu":
        return CPU_ONLY
    request = GpuRequest(
        visible=ids,
        gpu_bytes=smallest_gpu_bytes(len(ids)) if ids else 0,
        replicas=replicas_here if replica_device == "cuda" else 0,
        tensor_parallel_size=section.tensor_parallel_size,
        trainer_ranks=trainer_ranks if trainer_device == "cuda" else 0,
        param_count=param_count(model_dir),
        replica_gpus=section.gpus,
        trainer_gpus=trainer.gpus,
        colocate=section.colocate,
        gpu_memory_utilization=section.gpu_memory_utilization,
        margin_bytes=int(section.colocate_margin_gib * _GIB),
    )
    return Placement(replica_device, trainer_device, plan_gpus(request))
