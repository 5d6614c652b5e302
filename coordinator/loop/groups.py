"""A finished GRPO group and how it becomes trainer samples (pure).

A group is the n rollouts of one task. Failed rollouts are left out (their reasons counted);
a group with fewer than `min_group_size` usable rollouts, or with zero reward variance when
filtering is on, is dropped and counted, never sent to the trainer empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockgate.gateway.records.advantages import (
    AdvantageEstimator,
    AdvantageSpec,
    trained_advantages,
)
from lockgate.gateway.schema import SessionSamples
from lockgate.trainer.batch import TrainSample


@dataclass
class Rollout:
    reward: float
    samples: SessionSamples


@dataclass
class Group:
    task_id: str
    group_id: str
    dispatch_version: int
    rollouts: list[Rollout]
    failures: dict[str, int] = field(default_factory=dict)
    serial: int = 0  # its place in the dispatch order (see loop_state.py)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    def token_versions(self) -> list[int]:
        return [
            v
            for r in self.rollouts
            for s in r.samples.samples
            for v, m in zip(s.versions, s.loss_mask, strict=True)
            if m
        ]


def drop_reason(group: Group, *, min_group_size: int, drop_zero_variance: bool) -> str | None:
    if len(group.rollouts) < min_group_size:
        return "too_few_rollouts"
    if drop_zero_variance and len(set(group.rewards)) <= 1:
        return "zero_variance"
    return None


def group_to_train_samples(
    group: Group, *, estimator: AdvantageEstimator = "grpo", negative_weight: float = 1.0
) -> list[TrainSample]:
    spec = AdvantageSpec(estimator=estimator, negative_advantage_weight=negative_weight)
    advantages = trained_advantages(group.rewards, spec)
    out: list[TrainSample] = []
    for rollout, adv in zip(group.rollouts, advantages, strict=True):
        for sample in rollout.samples.samples:
            out.append(
                TrainSample(
                    input_ids=sample.input_ids,
                    loss_mask=sample.loss_mask,
                    rollout_logprobs=sample.logprobs,
                    advantages=[adv if m else 0.0 for m in sample.loss_mask],
                )
            )
    return out
