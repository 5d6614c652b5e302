import math

import pytest

from lockgate.coordinator.loop.staleness import StalenessController
from lockgate.gateway.records.advantages import grpo_advantages


def test_grpo_advantages_match_a_hand_computed_reference() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    adv = grpo_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert adv == [1.0, -1.0, -1.0, 1.0]
    adv = grpo_advantages([3.0, 1.0], normalize_std=False)
    assert adv == [1.0, -1.0]
    # zero variance: all zero, no division blow-up
    assert grpo_advantages([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)
    adv = grpo_advantages([0.0, 1.0, 2.0], eps=0.0)
    std = math.sqrt(2 / 3)
    assert adv == pytest.approx([-1 / std, 0.0, 1 / std])


def test_staleness_controller_capacity() -> None:
    # eta = 0, B = 2: two groups may start at version 0, none more until version 1
    c = StalenessController(groups_per_step=2, max_staleness=0)
    assert [c.can_start(0) for _ in range(1)] == [True]
    c.started()
    c.started()
    assert not c.can_start(0)
    assert c.can_start(1)
    # eta = 1: step k+1's groups may start while step k trains
    c = StalenessController(groups_per_step=2, max_staleness=1)
    for _ in range(4):
        assert c.can_start(0)
        c.started()
    assert not c.can_start(0)
    c.cancelled()
    assert c.can_start(0)


def test_staleness_controller_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        StalenessController(groups_per_step=0, max_staleness=0)
    with pytest.raises(ValueError):
        StalenessController(groups_per_step=1, max_staleness=-1)
