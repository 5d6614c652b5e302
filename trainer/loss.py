"""Policy-gradient losses on per-token tensors (pure torch, no model, no distribution).

Shapes: every per-token tensor is [B, T], aligned with the input ids; `mask` is 1.0 on tokens
that are trained on. Three policies appear:

- pi_theta, the policy being trained (`logprobs`, with gradient);
- pi_rollout, whatever sampled the tokens: vLLM at some weight version (`rollout_logprobs`);
- pi_prox, the trainer's weights at the start of the step (`proximal_logprobs`, no gradient).

"bypass" mode has no pi_prox: the PPO ratio is pi_theta / pi_rollout and no extra forward
pass is needed. "decoupled" mode (AReaL's decoupled PPO) clips pi_theta / pi_prox, a trust
region around recent weights rather than around whatever stale version sampled the tokens,
and corrects for sampling by pi_rollout with the behaviour weight pi_prox / pi_rollout, which
truncated importance sampling (TIS) may cap.

Per token, with A the advantage, r the PPO ratio and b the behaviour weight:

    loss_t = -b * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
             + kl_coef * k3(pi_theta, pi_ref) - entropy_coef * H_t

and the batch loss is sum_s w_s * sum_t mask * loss_t with w_s from `sample_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from lockgate.trainer.config import LossAggregation, TisLevel, TrainerConfig

# A chunk of positions holds at most this many logits (256 MiB in float32). Over a real vocabulary
# (151,936 for Qwen3) one 8,192-token micro-batch is 1.2e9 logits: 5 GiB per float32 copy, and
# log-softmax, its exponent and the saved input each make one. Chunks bound those copies;
# the model's own logits and their gradient stay whole.
CHUNK_LOGITS = 1 << 26


def _chunk_sizes(logits: torch.Tensor) -> list[int]:
    """Positions per chunk of [B, T, V] logits."""
    b, t, v = logits.shape
    step = max(1, CHUNK_LOGITS // max(1, b * v))
    return [min(step, t - a) for a in range(0, t, step)]


def _per_chunk(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, *rest: torch.Tensor
) -> torch.Tensor:
    """fn over chunks of positions, concatenated. With gradient each chunk is checkpointed:
    backward recomputes its float32 work instead of keeping it (the values and gradients are
    those of one call: every position is computed alone)."""
    sizes = _chunk_sizes(logits)
    if len(sizes) == 1:
        return fn(logits, *rest)
    keep = torch.is_grad_enabled() and logits.requires_grad
    # split, not slices: a slice's backward writes its gradient into a zero tensor of the full
    # size, one per chunk; split's gathers the chunks' gradients once.
    pieces = zip(
        torch.split(logits, sizes, dim=1),
        *(torch.split(r, sizes, dim=1) for r in rest),
        strict=True,
    )
    parts = [
        checkpoint(fn, *piece, use_reentrant=False) if keep else fn(*piece) for piece in pieces
    ]
    return torch.cat(parts, dim=1)


def _picked_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1; column 0 is 0 (nothing predicts it).

    Uses gather - logsumexp rather than a full log_softmax, over chunks of positions, so that
    at most one chunk's float32 logits are alive at a time.
    """
    out = _per_chunk(_picked_logprobs, logits[:, :-1], input_ids[:, 1:])
    return torch.nn.functional.pad(out, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, aligned like token_logprobs."""
    ent = _per_chunk(_entropy, logits[:, :-1])
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


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(q || p) from samples of q, given log(p / q) per sample.

    exp(x) - 1 - x is non-negative for every sample (unlike the plain -x), unbiased, and has low
    variance when p and q are close, which is the regime both uses here are in.
    """
    return torch.exp(log_ratio) - 1.0 - log_ratio


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, *, clip_eps_low: float, clip_eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's min(r * A, clip(r) * A) with asymmetric clipping (DAPO's clip-higher).

    Also returns where the clip is active, which is where the token's gradient vanishes: below
    the range with A < 0 ("low") and above it with A > 0 ("high").
    """
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    with torch.no_grad():
        active = clipped < unclipped
        return surrogate, active & (ratio < 1.0), active & (ratio > 1.0)


@dataclass(frozen=True)
class BehaviourWeights:
    weights: torch.Tensor  # [B, T], no gradient; what multiplies the surrogate
    truncated: torch.Tensor  # [B, T] 1.0 on trained tokens whose weight the cap lowered


def behaviour_weights(
    proximal_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: TisLevel,
    cap: float,
) -> BehaviourWeights:
    """pi_prox / pi_rollout, untruncated ("none"), or truncated at `cap` per token or per sequence.

    The sequence weight is exp(sum of the log-ratios over the sequence's trained tokens), i.e.
    the product of the token ratios: that is the likelihood ratio of the sampled sequence, the
    correct importance weight for a sequence-level reward, and the cap bounds its variance. The
    geometric mean (exp of the mean) would be length-independent but is the ratio of no pair of
    distributions, so its bias would not be controlled by the cap. With the product, long or
    badly mismatched sequences hit the cap more often; `truncated` makes that visible.
    """
    with torch.no_grad():
        log_w = (proximal_logprobs - rollout_logprobs) * mask
        if level == "none":
            return BehaviourWeights(torch.exp(log_w), torch.zeros_like(mask))
        log_cap = math.log(cap)
        if level == "token":
            return BehaviourWeights(
                torch.exp(log_w.clamp(max=log_cap)), (log_w > log_cap).float() * mask
            )
        if level == "sequence":
            # In log space: the product of hundreds of ratios would overflow before the cap.
            log_seq = log_w.sum(-1, keepdim=True)
            weights = torch.exp(log_seq.clamp(max=log_cap)).expand_as(log_w)
            return BehaviourWeights(weights, (log_seq > log_cap).float() * mask)
    raise ValueError(f"unknown tis_level {level!r}")


@dataclass(frozen=True)
class LossSpec:
    clip_eps_low: float
    clip_eps_high: float
    tis_level: TisLevel = "none"
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    @classmethod
    def from_config(cls, config: TrainerConfig) -> LossSpec:
        return cls(
            clip_eps_low=config.clip_eps_low,
            clip_eps_high=config.clip_eps_high,
            tis_level=config.tis_level,
            tis_cap=config.tis_cap,
            kl_coef=config.kl_coef,
            entropy_coef=config.entropy_coef,
        )


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch. Per-token tensors are [B, T]; `sample_weights` is [B]."""

    logprobs: torch.Tensor  # pi_theta, with gradient
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    sample_weights: torch.Tensor
    proximal_logprobs: torch.Tensor | None = None  # decoupled mode; None is bypass
    reference_logprobs: torch.Tensor | None = None  # needed when kl_coef > 0
    entropy: torch.Tensor | None = None  # with gradient when entropy_coef != 0; else for metrics


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar: this micro-batch's share of the batch loss
    # The rest are detached sums or extremes over trained tokens, for metrics (the caller reduces
    # them across micro-batches and ranks). Extremes are -inf / +inf when there are no tokens.
    tokens: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    is_weight_sum: torch.Tensor
    is_weight_max: torch.Tensor
    is_weight_min: torch.Tensor
    tis_truncated: torch.Tensor
    mismatch_kl_sum: torch.Tensor  # k3 of KL(pi_rollout || trainer at the start of the step)
    ref_kl_sum: torch.Tensor  # k3 of KL(pi_theta || pi_ref); 0 without a reference
    entropy_sum: torch.Tensor


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, -math.inf).max()


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, math.inf).min()


def policy_loss(x: LossInputs, spec: LossSpec) -> LossTerms:
    """The per-token objective of the module docstring, aggregated with `x.sample_weights`."""
    mask = x.mask
    if x.proximal_logprobs is None:
        if spec.tis_level != "none":
            raise ValueError("truncated importance sampling needs proximal logprobs (decoupled)")
        anchor = x.rollout_logprobs
        behaviour = BehaviourWeights(torch.ones_like(mask), torch.zeros_like(mask))
    else:
        anchor = x.proximal_logprobs
        behaviour = behaviour_weights(
            x.proximal_logprobs, x.rollout_logprobs, mask, level=spec.tis_level, cap=spec.tis_cap
        )
    # Log space, masked first: untrained positions hold arbitrary logprobs and must give ratio 1.
    log_ratio = (x.logprobs - anchor.detach()) * mask
    ratio = torch.exp(log_ratio)
    surrogate, clipped_low, clipped_high = clipped_surrogate(
        ratio, x.advantages, clip_eps_low=spec.clip_eps_low, clip_eps_high=spec.clip_eps_high
    )
    per_token = -behaviour.weights * surrogate

    ref_kl = torch.zeros_like(mask)
    if spec.kl_coef > 0:
        if x.reference_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        ref_kl = k3((x.reference_logprobs.detach() - x.logprobs) * mask)
        per_token = per_token + spec.kl_coef * ref_kl
    if spec.entropy_coef != 0:
        if x.entropy is None:
            raise ValueError("entropy_coef != 0 needs the entropy (with gradient)")
        per_token = per_token - spec.entropy_coef * x.entropy

    loss = (per_token * mask).sum(-1).mul(x.sample_weights).sum()
    with torch.no_grad():
        start = x.proximal_logprobs if x.proximal_logprobs is not None else x.logprobs
        mismatch = k3((start.detach() - x.rollout_logprobs) * mask) * mask
        entropy = x.entropy.detach() if x.entropy is not None else torch.zeros_like(mask)
        ratio = ratio.detach()
        return LossTerms(
            loss=loss,
            tokens=mask.sum(),
            clipped_low=(clipped_low.float() * mask).sum(),
            clipped_high=(clipped_high.float() * mask).sum(),
            ratio_sum=(ratio * mask).sum(),
            ratio_max=_masked_max(ratio, mask),
            ratio_min=_masked_min(ratio, mask),
            is_weight_sum=(behaviour.weights * mask).sum(),
            is_weight_max=_masked_max(behaviour.weights, mask),
            is_weight_min=_masked_min(behaviour.weights, mask),
            tis_truncated=behaviour.truncated.sum(),
            mismatch_kl_sum=mismatch.sum(),
            ref_kl_sum=(ref_kl.detach() * mask).sum(),
            entropy_sum=(entropy * mask).sum(),
        )
