"""Staleness: the dispatch gate, the max-off-policy bound at consumption and the histogram (a real
η = 0 run: tests/vllm/test_staleness.py)."""

from __future__ import annotations

import pytest

from lockgate.coordinator.config import LoopSection
from lockgate.coordinator.loop.groups import Group, Rollout
from lockgate.coordinator.loop.staleness import (
    StalenessController,
    drop_stale_rollouts,
    oldest_allowed_version,
    staleness_counts,
)
from lockgate.gateway.schema import SessionInfo, SessionSamples, TrajectorySample


def _rollout(versions: list[int], reward: float = 1.0) -> Rollout:
    info = SessionInfo(
        session_id="s", task_id="t", group_id="g", metadata={}, status="finished", reward=reward,
        error=None, created_at=0.0, finished_at=0.0, num_calls=1, rerender_splits=0,
    )  # fmt: skip
    sample = TrajectorySample(
        input_ids=[7] * (len(versions) + 1),
        loss_mask=[0] + [1] * len(versions),
        logprobs=[0.0] * (len(versions) + 1),
        versions=[-1, *versions],
        call_indices=[0],
    )
    return Rollout(reward, SessionSamples(session=info, samples=[sample], splits=0))


def test_the_gate_lets_eta_plus_one_steps_of_groups_start_per_version() -> None:
    # B = 3, η = 2: at version v, (v + 3) * 3 groups may have started in all.
    c = StalenessController(groups_per_step=3, max_staleness=2)
    started = 0
    while c.can_start(0):
        c.started()
        started += 1
    assert started == 9
    assert [c.capacity(v) for v in range(3)] == [9, 12, 15]
    c.cancelled()  # a dropped group frees its slot for a replacement
    assert c.can_start(0)


def test_the_bound_drops_whole_rollouts_holding_a_token_older_than_it() -> None:
    # Step 4 trains from version 3; bound 1 allows versions >= 2.
    assert oldest_allowed_version(4, 1) == 2
    group = Group("t", "g", 1, [_rollout([2, 3]), _rollout([1, 2]), _rollout([3]), _rollout([])])
    kept, dropped = drop_stale_rollouts(group, step=4, max_off_policy=1)
    assert dropped == 1
    assert [r.samples.samples[0].versions[1:] for r in kept.rollouts] == [[2, 3], [3], []]
    assert len(group.rollouts) == 4  # the input group is left as it was
    same, none = drop_stale_rollouts(group, step=4, max_off_policy=None)
    assert same is group and none == 0
    _, all_old = drop_stale_rollouts(group, step=10, max_off_policy=0)
    assert all_old == 3  # only the rollout with no trained token stays


def test_the_histogram_counts_trained_tokens_by_versions_behind() -> None:
    assert staleness_counts(3, [2, 2, 1, 0, 2]) == {"0": 3, "1": 1, "2": 1}
    assert staleness_counts(1, []) == {}


def test_the_off_policy_bound_defaults_to_the_dispatch_bound() -> None:
    assert LoopSection(max_staleness=2).off_policy_bound == 2
    assert LoopSection(max_staleness=2, max_off_policy=0).off_policy_bound == 0


def test_bounds_that_cannot_cover_the_steps_between_syncs_are_config_errors() -> None:
    LoopSection(sync_every=3, max_staleness=2)
    with pytest.raises(ValueError, match="stall"):
        LoopSection(sync_every=2, max_staleness=0)
    with pytest.raises(ValueError, match="drop every rollout"):
        LoopSection(sync_every=3, max_staleness=2, max_off_policy=1)
