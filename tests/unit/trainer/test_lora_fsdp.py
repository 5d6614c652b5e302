"""LoRA under FSDP2: two gloo ranks, each decoder layer one unit holding frozen base weights and
trainable adapters, give the loss and adapter gradients of one unsharded process, and no
gradient on the base. Two spawned processes (no torchrun), the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lockgate.trainer.config import ComputeDtype, LoraSpec
from lockgate.trainer.lora import is_lora_name
from lockgate.trainer.model import forward_logits, pad_batch
from lockgate.trainer.parallel import shard_model
from tests.support.lora_models import trained_lora_model

SPEC = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
LENGTHS = [24, 31]
CPU = torch.device("cpu")


def _rows(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _loss(model: torch.nn.Module, rows: list[list[int]], tokens: int) -> torch.Tensor:
    """-sum of the rows' next-token logprobs over `tokens` (the whole batch's count)."""
    ids = pad_batch(rows, torch.long, CPU)
    logits = forward_logits(model, ids, [len(r) for r in rows], pack=True)
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.zeros_like(logprobs)
    for i, row in enumerate(rows):
        mask[i, : len(row) - 1] = 1
    return -(logprobs * mask).sum() / tokens


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            out[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    return out


def _rank(
    rank: int, model_dir: Path, rendezvous: Path, out: Path, checkpointing: bool, dtype: str
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = trained_lora_model(model_dir, SPEC)
        shard_model(
            model,
            init_device_mesh("cpu", (2,)),
            activation_checkpointing=checkpointing,
            compute_dtype=dtype,  # type: ignore[arg-type]
        )
        rows = _rows(model.config.vocab_size)
        tokens = sum(n - 1 for n in LENGTHS)
        # One sample per rank; FSDP2 averages gradients over ranks, so undo the average.
        loss = _loss(model, [rows[rank]], tokens)
        (loss * 2).backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = _grads(model)
        if rank == 0:
            torch.save({"loss": total, "grads": grads}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("checkpointing", "dtype"), [(True, "float32"), (False, "bfloat16")])
def test_two_fsdp2_ranks_give_one_process_loss_and_adapter_grads(
    tiny_model_dir: Path, tmp_path: Path, checkpointing: bool, dtype: ComputeDtype
) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(
        _rank,
        args=(tiny_model_dir, tmp_path / "rendezvous", out, checkpointing, dtype),
        nprocs=2,
        join=True,
    )
    sharded = torch.load(out, weights_only=True)
    model = trained_lora_model(tiny_model_dir, SPEC)
    rows = _rows(model.config.vocab_size)
    loss = _loss(model, rows, sum(n - 1 for n in LENGTHS))
    loss.backward()
    grads = _grads(model)
    names = {n.replace("._checkpoint_wrapped_module", "") for n in sharded["grads"]}
    assert names == set(grads)
    assert grads and all(is_lora_name(n) for n in grads)  # the frozen base gets no gradient
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == "float32" else {"atol": 5e-3, "rtol": 0.1}
    torch.testing.assert_close(sharded["loss"], loss.detach(), **tolerance)
    for name, grad in sharded["grads"].items():
        theirs = grads[name.replace("._checkpoint_wrapped_module", "")]
        if dtype == "float32":
            torch.testing.assert_close(grad, theirs, **tolerance)
        else:  # bf16 compute: the same direction, not the same digits
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), theirs.flatten(), dim=0)
            assert float(cosine) > 0.98, name
