"""LoRA checkpoints: DCP saves and loads only the adapters and their optimizer state (the base
comes from the model dir at start), and a fresh model that loads one computes the saved
model's logits exactly and goes on with the same optimizer state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lockgate.trainer.checkpoint import load_checkpoint, save_checkpoint
from lockgate.trainer.config import LoraSpec, TrainerConfig
from lockgate.trainer.lora import is_lora_name
from lockgate.trainer.model import forward_logits, load_policy, pad_batch
from lockgate.trainer.parallel import Distributed, shard_model
from lockgate.trainer.step import build_optimizer

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, alpha=8)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[Distributed]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield Distributed(0, 1, CPU, init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def _sharded(model_dir: Path, world: Distributed, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # another seed draws another A: the checkpoint must bring its own
    model = load_policy(model_dir, CPU, SPEC)
    shard_model(model, world.mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return forward_logits(model.eval(), ids, [ids.shape[1]] * len(ids), pack=True)


def test_a_lora_checkpoint_holds_the_adapters_and_restores_them_exactly(
    tiny_model_dir: Path, tmp_path: Path, world: Distributed
) -> None:
    config = TrainerConfig(model_dir=tiny_model_dir, lr=1e-2, lora=SPEC)
    model = _sharded(tiny_model_dir, world, seed=0)
    optimizer = build_optimizer(model, config)
    gen = torch.Generator().manual_seed(2)
    ids = pad_batch(torch.randint(0, 1024, (2, 24), generator=gen).tolist(), torch.long, CPU)
    for _ in range(2):  # two steps: A and B both move, AdamW has state
        optimizer.zero_grad()
        forward_logits(model.train(), ids, [24, 24], pack=True).logsumexp(-1).mean().backward()
        optimizer.step()
    path = save_checkpoint(tmp_path / "ckpt", 2, model, optimizer, world, keep=2)

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert weights and all(is_lora_name(k) for k in weights)  # no base weight in the checkpoint
    assert any(k.startswith("optimizer.state.") for k in saved)

    fresh = _sharded(tiny_model_dir, world, seed=1)
    fresh_optimizer = build_optimizer(fresh, config)
    assert not torch.equal(_logits(fresh, ids), _logits(model, ids))
    assert load_checkpoint(path, fresh, fresh_optimizer, world) == 2
    assert torch.equal(_logits(fresh, ids), _logits(model, ids))
    ours = dict(model.named_parameters())
    for name, param in fresh.named_parameters():
        if param.requires_grad:
            mine, theirs = optimizer.state[ours[name]], fresh_optimizer.state[param]
            assert torch.equal(_full(mine["exp_avg_sq"]), _full(theirs["exp_avg_sq"])), name
