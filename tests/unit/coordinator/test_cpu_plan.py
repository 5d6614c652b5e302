"""The CPU plan (coordinator/cpu_plan.py) over faked core counts, and the configs' `auto`."""

from __future__ import annotations

import os

import pytest

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.cpu_plan import plan_cpus
from lockgate.trainer.sft.config import SFTTrainerSection, threads_alone


def test_two_cores_are_planned_as_the_recipes_were_tuned() -> None:
    plan = plan_cpus([0, 1])
    assert plan.replica_binds == ("0", "1")
    assert (plan.trainer_ranks, plan.threads_per_rank) == (1, 1)
    assert plan.shared
    assert plan.line() == (
        "CPU plan for 2 core(s): 2 replica(s) bound to 0, 1; "
        "1 trainer rank(s) x 1 thread(s) sharing them"
    )


def test_one_core_runs_one_replica_beside_a_one_thread_rank() -> None:
    plan = plan_cpus([0])
    assert plan.replica_binds == ("0",)
    assert plan.threads_per_rank == 1
    assert plan.shared


def test_four_cores_split_between_replicas_and_trainer() -> None:
    plan = plan_cpus([0, 1, 2, 3])
    assert plan.replica_binds == ("0", "1")
    assert plan.trainer_cores == (2, 3)
    assert plan.threads_per_rank == 2
    assert not plan.shared


def test_sixteen_cores_give_more_threads_to_each_part_on_disjoint_cores() -> None:
    plan = plan_cpus(range(16))
    assert plan.replica_binds == ("0-3", "4-7")
    assert plan.trainer_cores == tuple(range(8, 16))
    assert plan.threads_per_rank == 8
    assert plan.line().endswith("1 trainer rank(s) x 8 thread(s) on the cores left (8-15)")
    # Two ranks share the trainer's half.
    assert plan_cpus(range(16), trainer_ranks=2).threads_per_rank == 4


def test_many_cores_start_more_replicas_rather_than_wider_ones() -> None:
    assert plan_cpus(range(64)).replicas == 8


def test_explicit_numbers_are_honoured() -> None:
    # More replicas than cores share them round robin, one core each, as the launcher did.
    assert plan_cpus([0, 1], replicas=3).replica_binds == ("0", "1", "0")
    assert plan_cpus(range(16), replicas=3).replica_binds == ("0-2", "3-5", "6-7")
    assert plan_cpus(range(16), threads_per_rank=1).threads_per_rank == 1


def test_an_affinity_set_with_gaps_is_bound_as_ranges() -> None:
    plan = plan_cpus([2, 3, 4, 5, 8, 9, 10, 11])
    assert plan.replica_binds == ("2-3", "4-5")
    assert plan.trainer_cores == (8, 9, 10, 11)


def test_no_cores_is_an_error() -> None:
    with pytest.raises(ValueError, match="no usable CPU cores"):
        plan_cpus([])


@pytest.mark.parametrize(("cores", "replicas", "threads"), [(1, 1, 1), (2, 2, 1), (16, 2, 8)])
def test_a_run_configs_auto_follows_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, replicas: int, threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    config = RunConfig.model_validate(
        {"replicas": {"count": "auto"}, "trainer": {"num_threads": "auto"}}
    )
    assert config.replicas.count == replicas
    assert config.trainer.num_threads == threads


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"), [(1, 2, 1), (2, 1, 2), (2, 2, 1), (16, 2, 8)]
)
def test_sfts_auto_threads_share_every_core_among_the_ranks(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, threads: int
) -> None:
    assert threads_alone(cores, ranks) == threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    section = SFTTrainerSection.model_validate({"world_size": ranks, "num_threads": "auto"})
    assert section.num_threads == threads


def test_busy_cores_are_the_share_of_time_neither_idle_nor_waiting_on_io() -> None:
    from lockgate.coordinator.cpu_plan import busy_cores

    # user nice system idle iowait irq softirq steal, in jiffies
    before = [100, 0, 50, 1000, 10, 0, 0, 0]
    half_busy = [150, 0, 100, 1090, 20, 0, 0, 0]  # 100 busy, 100 idle or iowait
    assert busy_cores(before, half_busy, cores=2) == pytest.approx(1.0)
    assert busy_cores(before, [100, 0, 50, 1200, 10, 0, 0, 0], cores=2) == 0.0
    assert busy_cores(before, before, cores=2) == 0.0


def test_sft_ranks_spin_only_on_a_free_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from lockgate.coordinator.launch import sft

    monkeypatch.setattr(sft, "busy_cores_here", lambda: 0.1)
    assert sft._machine_is_free()
    monkeypatch.setattr(sft, "busy_cores_here", lambda: 1.6)
    assert not sft._machine_is_free()
