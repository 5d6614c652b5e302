"""Process group and FSDP2 sharding.

CPU ranks talk over gloo, GPU ranks over NCCL; the model code is the same. Each decoder layer
is its own FSDP2 unit so only one layer's full parameters are gathered at a time. Activation
checkpointing, when asked for, wraps each layer before it is sharded (torchtitan's order), so
FSDP2 shards the wrapper and recomputation re-gathers the layer's parameters like a forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lockgate.trainer.config import ComputeDtype, Device, Packing


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    # Run a micro-batch as one packed row (else one sample at a time): model.forward_logits.
    pack: bool = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: Device, local_rank: int, local_world_size: int) -> str:
    """ "cuda" or "cpu" for this node's ranks, the same for all of them.

    `auto` takes CUDA only when every rank on the node gets a GPU of its own; asking for cuda
    without enough GPUs is an error rather than a silent fall-back to the CPU.
    """
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        return "cuda" if 0 < local_world_size <= visible else "cpu"
    if device == "cuda" and local_rank >= visible:
        raise RuntimeError(
            f"trainer device is cuda but rank {local_rank} has no GPU: {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "run one rank per GPU, or set the trainer's device to cpu"
        )
    return device


def init_distributed(device: Device = "auto", packing: Packing = "auto") -> Distributed:
    """Join the process group torchrun describes (a world of one when run without torchrun)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    local = int(os.environ["LOCAL_RANK"])
    if resolve_device(device, local, int(os.environ["LOCAL_WORLD_SIZE"])) == "cuda":
        torch.cuda.set_device(local)
        # NCCL for the model's tensors, gloo for the step's bookkeeping on CPU tensors
        # (micro-batch counts, metric sums, broadcast objects): NCCL alone rejects those.
        where, backend, mesh_type = torch.device("cuda", local), "cpu:gloo,cuda:nccl", "cuda"
    else:
        where, backend, mesh_type = torch.device("cpu"), "gloo", "cpu"
    dist.init_process_group(backend)
    mesh = init_device_mesh(mesh_type, (dist.get_world_size(),))
    size = dist.get_world_size()
    pack = packing == "packed" or (packing == "auto" and (where.type == "cuda" or size > 1))
    return Distributed(dist.get_rank(), size, where, mesh, pack)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    return layers


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    The wrapper's parameter names gain a prefix that torch's state-dict utilities strip, so
    snapshots and checkpoints keep the HF names (and a checkpoint loads with or without it).
    """
    layers = _decoder_layers(model)
    for i, layer in enumerate(layers):
        # The RNG state is kept (the default) so a model with dropout recomputes the same masks.
        layers[i] = checkpoint_wrapper(layer)


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool = False,
    compute_dtype: ComputeDtype = "auto",
) -> None:
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    # auto: bf16 compute with fp32 gradients on GPU; fp32 throughout on CPU. The rank programs
    # resolve auto first, with the CPU's flags (trainer/precision.py), and pass the result.
    bf16 = compute_dtype == "bfloat16" or (compute_dtype == "auto" and mesh.device_type == "cuda")
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
