"""Group-relative advantages (pure): one scalar per rollout of a group, from the group's rewards.

Estimators (`compute_advantages`):

- grpo: (r_i - mean) / (std + eps), std the population standard deviation of the group.
- grpo_no_std: r_i - mean. Dividing by the std up-weights groups whose rewards barely differ
  (nearly solved or nearly hopeless tasks); leaving it out keeps the reward's scale.
- rloo: r_i - mean of the *other* rollouts' rewards (REINFORCE leave-one-out). The baseline
  does not depend on r_i, so the estimate stays unbiased; it equals n / (n - 1) * (r_i - mean).
- dr_grpo: Dr. GRPO's advantage is grpo_no_std. Its other fix, removing the per-sequence
  length normalisation, is not an advantage at all: it is the trainer's loss aggregation
  `seq-mean-token-sum` (trainer/config.py, `loss_agg`).

`weigh_negatives` then scales the advantages below zero (`algorithm.negative_advantage_weight`):
1 is the estimator as it is; 0 reinforces only the rollouts better than their group (positive
sample reinforcement, a filtered behaviour cloning). The reason to try it: pushing a small
model's sampled tokens down spreads their mass over everything else and raises its entropy
(seen at higher learning rates; what it did in the runs that tried it: docs/performance.md,
"Advantages").

`AdvantageSpec` is the pair a run trains with; the gateway's config carries it so the viewer
shows the advantages the run trained on (`member_advantages`), over the same rollouts the
coordinator counts (`group_reward`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

AdvantageEstimator = Literal["grpo", "grpo_no_std", "rloo", "dr_grpo"]


class AdvantageSpec(BaseModel):
    """How a run computes its advantages from a group's rewards."""

    model_config = ConfigDict(extra="forbid")
    estimator: AdvantageEstimator = Field(
        default="grpo",
        description="grpo (group mean/std), grpo_no_std, rloo (leave-one-out baseline) or "
        "dr_grpo (mean-centred; pair it with trainer.loss_agg=seq-mean-token-sum).",
    )
    negative_advantage_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Scales the advantages below zero: 1 is the estimator as it is, 0 trains on "
        "the rollouts better than their group only.",
    )


def grpo_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps), or unnormalised (Dr. GRPO style) if asked.

    std is the population standard deviation of the group.
    """
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


def rloo_advantages(rewards: Sequence[float]) -> list[float]:
    """A_i = r_i - (sum(r) - r_i) / (n - 1). A group of one has no baseline: its advantage is 0."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def weigh_negatives(advantages: Sequence[float], weight: float) -> list[float]:
    """The advantages with each negative one multiplied by `weight` (0..1)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"the negative advantages' weight must be in [0, 1], not {weight}")
    return [a if a >= 0 else a * weight for a in advantages]


def compute_advantages(
    rewards: Sequence[float], estimator: AdvantageEstimator, *, eps: float = 1e-6
) -> list[float]:
    """One advantage per reward, in order; `eps` only matters for "grpo"."""
    if estimator == "grpo":
        return grpo_advantages(rewards, normalize_std=True, eps=eps)
    if estimator in ("grpo_no_std", "dr_grpo"):
        return grpo_advantages(rewards, normalize_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    known = ", ".join(get_args(AdvantageEstimator))
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {known}")


def trained_advantages(rewards: Sequence[float], spec: AdvantageSpec) -> list[float]:
    """What a run trains with: the spec's estimator, then its weight on the negative ones."""
    return weigh_negatives(
        compute_advantages(rewards, spec.estimator), spec.negative_advantage_weight
    )


def group_reward(status: str, reward: float | None) -> float | None:
    """The reward a rollout brings to its group's advantages, or None: it is left out.

    Only a rollout that finished with a reward counts; a failed one (crashed, timed out, no
    reward) says nothing about how good its tokens were, and an open one has no reward yet.
    """
    return reward if status == "finished" else None


def member_advantages(
    members: Sequence[tuple[str, float | None]], spec: AdvantageSpec
) -> list[float | None]:
    """Each (status, reward) member's advantage under `spec`, computed over the members that
    count (`group_reward`); None for the others."""
    rewards = [group_reward(status, reward) for status, reward in members]
    counted = iter(trained_advantages([r for r in rewards if r is not None], spec))
    return [None if r is None else next(counted) for r in rewards]
