"""Process group and FSDP2 sharding.

CPU ranks talk over gloo, GPU ranks over NCCL; the model code is the same. Each decoder layer
is its own FSDP2 unit so only one layer's full parameters are gathered at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Distributed:
    """Join the process group torchrun describes (a world of one when run without torchrun)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if torch.cuda.is_available():
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device, backend, mesh_type = torch.device("cuda", local), "nccl", "cuda"
    else:
        device, backend, mesh_type = torch.device("cpu"), "gloo", "cpu"
    dist.init_process_group(backend)
    mesh = init_device_mesh(mesh_type, (dist.get_world_size(),))
    return Distributed(dist.get_rank(), dist.get_world_size(), device, mesh)


def shard_model(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    # bf16 compute with fp32 gradients on GPU; fp32 throughout on CPU (parity with vLLM's fp32).
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mesh.device_type == "cuda"
        else MixedPrecisionPolicy()
    )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
