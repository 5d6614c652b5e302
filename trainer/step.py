"""One trainer step on a batch, on every rank (each rank trains its share of the samples).

A step is `mini_batches` optimizer updates, each on a contiguous slice of the batch's samples
with its own loss normalisation. Within an update every rank runs the same number of
token-budget micro-batches and accumulates gradients. What differs between objectives lives in
two small strategies chosen once per step: where the proximal logprobs come from (`_Proximal`)
and whether a reference model is run; the loss itself is `loss.policy_loss`.

The objective-free parts (ranks' micro-batch plans with fillers, gradient accumulation, clipping
and the optimizer step, the learning rate, AdamW) are public: supervised fine-tuning (`sft.py`)
trains through the same ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lockgate.trainer.batch import TrainBatch, TrainSample
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.loss import (
    LossInputs,
    LossSpec,
    LossTerms,
    policy_loss,
    sample_weights,
    token_entropy,
    token_logprobs,
)
from lockgate.trainer.micro_batches import assign_to_ranks, plan_micro_batches
from lockgate.trainer.model import forward_logits, pad_batch
from lockgate.trainer.parallel import Distributed
from lockgate.trainer.schedule import learning_rate

# Summed and max-reduced metrics, in the order of the one all-reduce each per step. Minima are
# reduced as maxima of their negation.
_SUMS = (
    "loss",
    "tokens",
    "clipped_low",
    "clipped_high",
    "ratio_sum",
    "is_weight_sum",
    "tis_truncated",
    "mismatch_kl_sum",
    "ref_kl_sum",
    "entropy_sum",
)
_MAXES = ("ratio_max", "ratio_min", "is_weight_max", "is_weight_min")
_NEGATED = frozenset({"ratio_min", "is_weight_min"})

# (update index, sample indices, this micro-batch's logprobs) -> pi_prox, or None in bypass mode.
_Proximal = Callable[[int, list[int], torch.Tensor], torch.Tensor | None]


def split_mini_batches(n_samples: int, mini_batches: int) -> list[list[int]]:
    """Contiguous, near-equal slices of the sample indices (groups arrive contiguous, so a
    group's rollouts mostly land in the same update)."""
    if n_samples < mini_batches:
        raise ValueError(
            f"the batch has {n_samples} samples, fewer than mini_batches={mini_batches}"
        )
    base, extra = divmod(n_samples, mini_batches)
    out, start = [], 0
    for k in range(mini_batches):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def rank_micro_batches(
    indices: Sequence[int], lengths: Sequence[int], token_budget: int, world: Distributed
) -> list[list[int] | None]:
    """This rank's micro-batches of `indices`; None marks a filler.

    FSDP2 gathers parameters collectively in every forward, so all ranks must run the same
    number of micro-batches: a rank with fewer runs zero-weight fillers (`filler_sample`).
    """
    sub = [lengths[i] for i in indices]
    mine = [indices[p] for p in assign_to_ranks(sub, world.world_size)[world.rank]]
    plan: list[list[int] | None] = [
        [mine[p] for p in mb] for mb in plan_micro_batches([lengths[i] for i in mine], token_budget)
    ]
    count = torch.tensor([len(plan)], dtype=torch.long)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return plan + [None] * (int(count.item()) - len(plan))


def filler_sample(indices: Sequence[int], lengths: Sequence[int]) -> int:
    """The sample a filler micro-batch runs (with zero weight): the cheapest one."""
    return min(indices, key=lambda i: (lengths[i], i))


def _pad(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    return pad_batch(rows, torch.float32, device)


# -- strategies ---------------------------------------------------------------------------------


def _bypass(update: int, idx: list[int], logprobs: torch.Tensor) -> None:
    return None


@torch.no_grad()
def _decoupled(
    policy: torch.nn.Module,
    samples: list[TrainSample],
    minis: list[list[int]],
    config: TrainerConfig,
    world: Distributed,
) -> _Proximal:
    """pi_prox = the weights at the start of the step.

    The first update's forward runs on exactly those weights, so its own logprobs, detached,
    are the proximal ones at no extra cost. Later updates' samples need a no-grad pass before
    the first update changes the weights: with one update per batch there is none.
    """
    lengths = [len(s.input_ids) for s in samples]
    cached: dict[int, list[float]] = {}
    for mini in minis[1:]:
        # Planned exactly like the update will plan it, so each rank caches its own samples.
        for mb in rank_micro_batches(mini, lengths, config.micro_batch_tokens, world):
            idx = mb if mb is not None else [filler_sample(mini, lengths)]
            ids = pad_batch([samples[i].input_ids for i in idx], torch.long, world.device)
            lens = [lengths[i] for i in idx]
            lp = token_logprobs(forward_logits(policy, ids, lens, pack=world.pack), ids).cpu()
            if mb is not None:
                for row, i in enumerate(idx):
                    cached[i] = lp[row, : lengths[i]].tolist()

    def proximal(update: int, idx: list[int], logprobs: torch.Tensor) -> torch.Tensor:
        if update == 0:
            return logprobs.detach()
        return _pad([cached[i] for i in idx], logprobs.device)

    return proximal


def _reference_logprobs(
    reference: torch.nn.Module | None, ids: torch.Tensor, lengths: list[int], *, pack: bool
) -> torch.Tensor | None:
    if reference is None:
        return None
    with torch.no_grad():
        return token_logprobs(forward_logits(reference, ids, lengths, pack=pack), ids)


def _entropy(logits: torch.Tensor, *, bonus: bool) -> torch.Tensor:
    # Without a bonus the entropy is only a metric: keep its [B, T, V] tensors out of the graph.
    if bonus:
        return token_entropy(logits)
    with torch.no_grad():
        return token_entropy(logits.detach())


# -- metrics ------------------------------------------------------------------------------------


@dataclass
class _Totals:
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(len(_SUMS), dtype=torch.float64))
    maxes: torch.Tensor = field(
        default_factory=lambda: torch.full((len(_MAXES),), -math.inf, dtype=torch.float64)
    )
    micro_batches: int = 0

    def add(self, terms: LossTerms) -> None:
        # The terms live on the model's device; the totals stay on the CPU (reduced over gloo).
        self.sums += torch.stack(
            [getattr(terms, k).detach().double().reshape(()) for k in _SUMS]
        ).cpu()
        extremes = torch.stack(
            [
                (-1.0 if k in _NEGATED else 1.0) * getattr(terms, k).detach().double().reshape(())
                for k in _MAXES
            ]
        ).cpu()
        self.maxes = torch.maximum(self.maxes, extremes)

    def reduce(self, updates: int) -> dict[str, float]:
        dist.all_reduce(self.sums)
        dist.all_reduce(self.maxes, op=dist.ReduceOp.MAX)
        s = dict(zip(_SUMS, self.sums.tolist(), strict=True))
        m = {
            k: (-v if k in _NEGATED else v)
            for k, v in zip(_MAXES, self.maxes.tolist(), strict=True)
        }
        tokens = s["tokens"]
        if tokens == 0:  # nothing trained: keep the metrics finite (JSON has no inf)
            m = dict.fromkeys(m, 0.0)
        per_token = max(tokens, 1.0)
        return {
            "loss": s["loss"] / updates,
            "tokens": tokens,
            "clip_frac": (s["clipped_low"] + s["clipped_high"]) / per_token,
            "clip_frac_low": s["clipped_low"] / per_token,
            "clip_frac_high": s["clipped_high"] / per_token,
            "ratio_mean": s["ratio_sum"] / per_token,
            "ratio_max": m["ratio_max"],
            "ratio_min": m["ratio_min"],
            "is_weight_mean": s["is_weight_sum"] / per_token,
            "is_weight_max": m["is_weight_max"],
            "is_weight_min": m["is_weight_min"],
            "tis_truncated_frac": s["tis_truncated"] / per_token,
            "mismatch_kl": s["mismatch_kl_sum"] / per_token,
            "ref_kl": s["ref_kl_sum"] / per_token,
            "entropy": s["entropy_sum"] / per_token,
        }


# -- the step -----------------------------------------------------------------------------------


def _tensors(
    samples: list[TrainSample], weights: list[float], device: torch.device
) -> tuple[torch.Tensor, ...]:
    ids = pad_batch([s.input_ids for s in samples], torch.long, device)
    mask = _pad([s.loss_mask for s in samples], device)
    old = _pad([s.rollout_logprobs for s in samples], device)
    adv = _pad([s.advantages for s in samples], device)
    w = torch.tensor(weights, dtype=torch.float32, device=device)
    return ids, mask, old, adv, w


def accumulate_and_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Sequence[list[int] | None],
    micro_loss: Callable[[list[int] | None], torch.Tensor],
    *,
    grad_clip: float,
    world: Distributed,
) -> float:
    """One optimizer update: backward of `micro_loss(mb)` for every micro-batch of `plan` (a
    rank's `rank_micro_batches`, None for a filler), then clip and step. Each micro-batch's
    loss must already be weighted for the whole update across all ranks. Returns the gradient
    norm before clipping.
    """
    optimizer.zero_grad(set_to_none=True)
    for j, mb in enumerate(plan):
        if hasattr(policy, "set_requires_gradient_sync"):
            # Reduce-scatter gradients once, after the last micro-batch.
            policy.set_requires_gradient_sync(j == len(plan) - 1)
        # FSDP2 averages gradients over ranks; the weights already normalise over the whole
        # update, so undo the average to get its sum.
        (micro_loss(mb) * world.world_size).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    return float(grad_norm.item())


def set_learning_rate(optimizer: torch.optim.Optimizer, config: TrainerConfig, step: int) -> float:
    """Apply the schedule's rate for trainer step `step` to every parameter group."""
    lr = learning_rate(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def build_optimizer(policy: torch.nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters only: with LoRA the frozen base holds no state."""
    return torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=config.eps,
    )


def _update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[TrainSample],
    mini: list[int],
    update: int,
    *,
    proximal: _Proximal,
    reference: torch.nn.Module | None,
    spec: LossSpec,
    config: TrainerConfig,
    world: Distributed,
    totals: _Totals,
) -> float:
    """One optimizer update on the samples `mini`; returns the gradient norm before clipping."""
    lengths = [len(s.input_ids) for s in samples]
    weights = dict(
        zip(
            mini,
            sample_weights([sum(samples[i].loss_mask) for i in mini], config.loss_agg),
            strict=True,
        )
    )
    plan = rank_micro_batches(mini, lengths, config.micro_batch_tokens, world)
    totals.micro_batches += len(plan)
    filler = [filler_sample(mini, lengths)]

    def micro_loss(mb: list[int] | None) -> torch.Tensor:
        idx = mb if mb is not None else filler
        w = [weights[i] if mb is not None else 0.0 for i in idx]
        ids, mask, old, adv, wt = _tensors([samples[i] for i in idx], w, world.device)
        lens = [lengths[i] for i in idx]
        logits = forward_logits(policy, ids, lens, pack=world.pack)
        logprobs = token_logprobs(logits, ids)
        terms = policy_loss(
            LossInputs(
                logprobs=logprobs,
                rollout_logprobs=old,
                advantages=adv,
                mask=mask,
                sample_weights=wt,
                # A filler has zero weight and may hold another rank's sample: the rollout
                # logprobs stand in for its proximal ones (weight 1, same ratio as bypass).
                proximal_logprobs=proximal(update, idx, logprobs) if mb is not None else old,
                reference_logprobs=_reference_logprobs(reference, ids, lens, pack=world.pack),
                entropy=_entropy(logits, bonus=spec.entropy_coef != 0),
            ),
            spec,
        )
        if mb is not None:
            totals.add(terms)
        return terms.loss

    return accumulate_and_step(
        policy, optimizer, plan, micro_loss, grad_clip=config.grad_clip, world=world
    )


def train_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    config: TrainerConfig,
    world: Distributed,
    reference: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Train on `batch`; `reference` is the frozen initial policy, required when kl_coef > 0."""
    started = time.perf_counter()
    samples = batch.samples
    if not samples:
        raise ValueError(f"step {batch.step}: empty batch")
    if (reference is None) != (config.kl_coef == 0):
        raise ValueError("a reference model is needed exactly when kl_coef > 0")
    lr = set_learning_rate(optimizer, config, batch.step)

    minis = split_mini_batches(len(samples), config.mini_batches)
    policy.train()
    proximal: _Proximal = (
        _decoupled(policy, samples, minis, config, world)
        if config.ppo_mode == "decoupled"
        else _bypass
    )
    spec = LossSpec.from_config(config)
    totals = _Totals()
    grad_norms = [
        _update(
            policy,
            optimizer,
            samples,
            mini,
            k,
            proximal=proximal,
            reference=reference,
            spec=spec,
            config=config,
            world=world,
            totals=totals,
        )
        for k, mini in enumerate(minis)
    ]
    metrics = totals.reduce(len(minis))
    if config.kl_coef == 0:
        del metrics["ref_kl"]
    return {
        **metrics,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "grad_norm_max": max(grad_norms),
        "lr": lr,
        "updates": float(len(minis)),
        "micro_batches": float(totals.micro_batches),
        "samples": float(len(samples)),
        "step_time_s": time.perf_counter() - started,
    }
