"""Policy-gradient losses on per-token tensors (pure torch, no model, no distribution).

Shapes: every tensor is [B, T], aligned with the input ids; `mask` is 1.0 on tokens that are
trained on. The old policy is the rollout policy (PPO "bypass" mode): its logprobs are the ones
vLLM returned when it sampled the tokens, so no extra forward pass is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lockgate.trainer.config import LossAggregation


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1; column 0 is 0 (nothing predicts it).

    Uses gather - logsumexp rather than a full log_softmax so that only one [B, T, V] float
    tensor is alive at a time.
    """
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    out = picked - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(out, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, aligned like token_logprobs."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)


def sample_weights(loss_token_counts: Sequence[int], agg: LossAggregation) -> list[float]:
    """Per-sample weight w_s such that the batch loss is sum_s w_s * sum_t loss[s, t].

    Computed once over the whole batch (all ranks), so that splitting the batch across ranks
    and micro-batches does not change the loss: token-mean divides by the batch's trained
    tokens, not by each micro-batch's.
    """
    n_seqs = sum(1 for c in loss_token_counts if c > 0)
    total = sum(loss_token_counts)
    if total == 0:
        return [0.0] * len(loss_token_counts)
    if agg == "token-mean":
        return [1.0 / total] * len(loss_token_counts)
    if agg == "seq-mean-token-mean":
        return [1.0 / (c * n_seqs) if c else 0.0 for c in loss_token_counts]
    if agg == "seq-mean-token-sum":
        return [1.0 / n_seqs] * len(loss_token_counts)
    raise ValueError(f"unknown loss aggregation {agg!r}")


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar: this micro-batch's share of the batch loss
    # Sums over trained tokens, for metrics (reduced across ranks by the caller).
    clipped: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_max: torch.Tensor
    mismatch_kl_sum: torch.Tensor
    tokens: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> LossTerms:
    """PPO's clipped surrogate with asymmetric clipping (DAPO's clip-higher).

    `weights` is [B] (from `sample_weights`). The importance ratio is computed in log space and
    compared with the rollout policy's logprobs, so the first step on fresh samples has ratio ~1
    and later (stale) samples are clipped as PPO intends.
    """
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = -torch.minimum(unclipped, clipped_ratio * advantages)
    loss = (per_token * mask).sum(-1).mul(weights).sum()
    with torch.no_grad():
        was_clipped = (clipped_ratio * advantages < unclipped).float() * mask
        # k3 estimator of KL(rollout || trainer): non-negative, unbiased, low variance.
        k3 = (ratio - 1.0 - log_ratio) * mask
        return LossTerms(
            loss=loss,
            clipped=was_clipped.sum(),
            ratio_sum=(ratio * mask).sum(),
            ratio_max=(ratio * mask).max(),
            mismatch_kl_sum=k3.sum(),
            tokens=mask.sum(),
        )
