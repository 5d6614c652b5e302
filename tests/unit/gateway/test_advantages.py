"""Advantage estimators against hand-computed references."""

from __future__ import annotations

import math
from typing import get_args

import pytest

from lockgate.coordinator.loop.groups import Group, Rollout, group_to_train_samples
from lockgate.gateway.records.advantages import (
    AdvantageEstimator,
    compute_advantages,
    rloo_advantages,
    weigh_negatives,
)
from lockgate.gateway.schema import SessionInfo, SessionSamples, TrajectorySample

CENTRING_ONLY: tuple[AdvantageEstimator, ...] = ("grpo_no_std", "dr_grpo")


def test_grpo_divides_the_centred_rewards_by_the_population_std() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps)
    adv = compute_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    a = 0.5 / (0.5 + 1e-6)  # 0.999998
    assert adv == pytest.approx([a, -a, -a, a], abs=1e-12)
    # rewards 0, 1, 2: mean 1, std sqrt(2/3) = 0.8165
    adv = compute_advantages([0.0, 1.0, 2.0], "grpo", eps=0.0)
    assert adv == pytest.approx([-1 / math.sqrt(2 / 3), 0.0, 1 / math.sqrt(2 / 3)])


def test_grpo_no_std_and_dr_grpo_only_centre() -> None:
    # rewards 3, 1, 2: mean 2
    for estimator in CENTRING_ONLY:
        assert compute_advantages([3.0, 1.0, 2.0], estimator) == [1.0, -1.0, 0.0]
    # the reward's scale is kept: ten times the rewards, ten times the advantages
    assert compute_advantages([30.0, 10.0, 20.0], "dr_grpo") == [10.0, -10.0, 0.0]


def test_rloo_subtracts_the_mean_of_the_other_rollouts() -> None:
    # 1 - (0 + 0 + 1) / 3 = 2/3; 0 - (1 + 0 + 1) / 3 = -2/3
    adv = compute_advantages([1.0, 0.0, 0.0, 1.0], "rloo")
    assert adv == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # 4 - (1 + 1) / 2 = 3; 1 - (4 + 1) / 2 = -1.5
    adv = compute_advantages([4.0, 1.0, 1.0], "rloo")
    assert adv == pytest.approx([3.0, -1.5, -1.5])
    assert sum(adv) == pytest.approx(0.0)


def test_degenerate_groups_give_zero_advantages() -> None:
    for estimator in get_args(AdvantageEstimator):
        assert compute_advantages([0.7, 0.7, 0.7], estimator) == pytest.approx([0.0] * 3, abs=1e-6)
        assert compute_advantages([], estimator) == []
    assert rloo_advantages([5.0]) == [0.0]  # no other rollout to be the baseline


def test_an_unknown_estimator_is_refused() -> None:
    with pytest.raises(ValueError, match="'ppo'; expected one of grpo, grpo_no_std, rloo, dr_grpo"):
        compute_advantages([1.0, 0.0], "ppo")  # type: ignore[arg-type]


def test_weigh_negatives_scales_only_the_advantages_below_zero() -> None:
    advantages = compute_advantages([1.0, 0.0, 0.0, 0.5], "grpo_no_std")  # 0.625, -0.375, ...
    assert weigh_negatives(advantages, 1.0) == advantages
    assert weigh_negatives(advantages, 0.0) == [0.625, 0.0, 0.0, 0.125]
    assert weigh_negatives(advantages, 0.2) == pytest.approx([0.625, -0.075, -0.075, 0.125])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        weigh_negatives(advantages, 1.5)


def test_a_groups_samples_carry_the_weighed_advantage_on_sampled_tokens_only() -> None:
    group = _group_of_rewards([1.0, 0.0])
    kept = group_to_train_samples(group, estimator="grpo_no_std", negative_weight=0.0)
    assert [s.advantages for s in kept] == [[0.0, 0.5, 0.5], [0.0, 0.0, 0.0]]
    both = group_to_train_samples(group, estimator="grpo_no_std")
    assert [s.advantages for s in both] == [[0.0, 0.5, 0.5], [0.0, -0.5, -0.5]]


def _group_of_rewards(rewards: list[float]) -> Group:
    def rollout(reward: float) -> Rollout:
        info = SessionInfo(
            session_id="s", task_id="t", group_id="g", metadata={}, status="finished",
            reward=reward, error=None, created_at=0.0, finished_at=0.0, num_calls=1,
            rerender_splits=0,
        )  # fmt: skip
        sample = TrajectorySample(
            input_ids=[7, 8, 9], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, versions=[-1, 0, 0],
            call_indices=[0],
        )  # fmt: skip
        return Rollout(reward, SessionSamples(session=info, samples=[sample], splits=0))

    return Group("t", "g", 0, [rollout(r) for r in rewards])
