"""One optimizer step on a batch, on every rank (each rank trains its share of the samples)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lockgate.trainer.batch import TrainBatch, TrainSample
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.loss import ppo_clip_loss, sample_weights, token_entropy, token_logprobs
from lockgate.trainer.micro_batches import assign_to_ranks, plan_micro_batches
from lockgate.trainer.model import forward_logits, pad_batch
from lockgate.trainer.parallel import Distributed

# Order of the summed metrics in the one all-reduce per step.
_SUMS = ("loss", "clipped", "ratio_sum", "mismatch_kl_sum", "tokens", "entropy_sum")


def _tensors(
    samples: list[TrainSample], weights: list[float], device: torch.device
) -> tuple[torch.Tensor, ...]:
    ids = pad_batch([s.input_ids for s in samples], torch.long, device)
    mask = pad_batch([s.loss_mask for s in samples], torch.float32, device)
    old = pad_batch([s.rollout_logprobs for s in samples], torch.float32, device)
    adv = pad_batch([s.advantages for s in samples], torch.float32, device)
    w = torch.tensor(weights, dtype=torch.float32, device=device)
    return ids, mask, old, adv, w


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    config: TrainerConfig,
    world: Distributed,
) -> dict[str, float]:
    started = time.perf_counter()
    samples = batch.samples
    if not samples:
        raise ValueError(f"step {batch.step}: empty batch")
    lengths = [len(s.input_ids) for s in samples]
    weights = sample_weights([sum(s.loss_mask) for s in samples], config.loss_agg)
    mine = assign_to_ranks(lengths, world.world_size)[world.rank]
    plan = [
        [mine[p] for p in mb]
        for mb in plan_micro_batches([lengths[i] for i in mine], config.micro_batch_tokens)
    ]

    # FSDP2 gathers parameters collectively in every forward, so all ranks must run the same
    # number of micro-batches: a rank with fewer runs zero-weight ones.
    count = torch.tensor([len(plan)], dtype=torch.long)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    n_micro = int(count.item())

    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(len(_SUMS), dtype=torch.float64)
    ratio_max = torch.zeros(1, dtype=torch.float64)
    for j in range(n_micro):
        real = j < len(plan)
        idx = plan[j] if real else [min(range(len(samples)), key=lambda i: lengths[i])]
        w = [weights[i] if real else 0.0 for i in idx]
        ids, mask, old, adv, wt = _tensors([samples[i] for i in idx], w, world.device)
        if hasattr(model, "set_requires_gradient_sync"):
            # Reduce-scatter gradients once, after the last micro-batch.
            model.set_requires_gradient_sync(j == n_micro - 1)
        logits = forward_logits(model, ids, [lengths[i] for i in idx])
        terms = ppo_clip_loss(
            token_logprobs(logits, ids),
            old,
            adv,
            mask,
            wt,
            clip_eps_low=config.clip_eps_low,
            clip_eps_high=config.clip_eps_high,
        )
        # FSDP2 averages gradients over ranks; the weights already normalise over the whole
        # batch, so undo the average to get the batch's sum.
        (terms.loss * world.world_size).backward()
        if real:
            with torch.no_grad():
                entropy = (token_entropy(logits.detach()) * mask).sum()
            sums += torch.tensor(
                [
                    terms.loss.item(),
                    terms.clipped.item(),
                    terms.ratio_sum.item(),
                    terms.mismatch_kl_sum.item(),
                    terms.tokens.item(),
                    entropy.item(),
                ],
                dtype=torch.float64,
            )
            ratio_max = torch.maximum(ratio_max, terms.ratio_max.detach().double().reshape(1))
        del logits

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()

    dist.all_reduce(sums)
    dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
    total = dict(zip(_SUMS, sums.tolist(), strict=True))
    tokens = max(total["tokens"], 1.0)
    return {
        "loss": total["loss"],
        "clip_frac": total["clipped"] / tokens,
        "ratio_mean": total["ratio_sum"] / tokens,
        "ratio_max": float(ratio_max.item()),
        "mismatch_kl": total["mismatch_kl_sum"] / tokens,
        "entropy": total["entropy_sum"] / tokens,
        "grad_norm": float(grad_norm.item()),
        "tokens": total["tokens"],
        "samples": float(len(samples)),
        "micro_batches": float(n_micro),
        "step_time_s": time.perf_counter() - started,
    }
