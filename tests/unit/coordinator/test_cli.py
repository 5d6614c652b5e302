"""The CLI's contract for bad input: one line on stderr naming the problem, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.coordinator.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def _lockgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("loop:\n  steps: -3\n", "loop.steps"),
        ("loop:\n  stepz: 3\n", "loop.stepz"),
        ("trainer:\n  lr: lots\n", "trainer.lr"),
        ("- just\n- a list\n", "mapping"),
    ],
)
def test_a_bad_config_gets_a_one_line_error_naming_the_field(
    tmp_path: Path, content: str, needle: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = _lockgate("train", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lockgate: ") and needle in lines[0]


def test_a_missing_config_file_and_a_bad_override_are_one_line_errors(tmp_path: Path) -> None:
    result = _lockgate("train", str(tmp_path / "nope.yaml"))
    assert (
        result.returncode == 2
        and "not found" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    )
    result = _lockgate("train", str(ROOT / "examples/toy/config.yaml"), "--set", "loop.steps")
    assert result.returncode == 2 and "section.field=value" in result.stderr


def test_help_documents_every_option() -> None:
    result = _lockgate("train", "--help")
    assert result.returncode == 0
    for option in (
        "loop.max_staleness",
        "loop.group_size",
        "trainer.lr",
        "replicas.count",
        "gateway.sampling",
        "metrics.tensorboard",
        "metrics.wandb.project",  # inside an optional section
    ):
        assert option in result.stdout


def test_the_shipped_configs_parse_and_overrides_apply() -> None:
    config = load_config(ROOT / "examples/toy/config.yaml", ["loop.steps=5", "trainer.lr=0.01"])
    assert config.loop.steps == 5
    assert config.trainer.lr == 0.01
    assert config.environment.path == (ROOT / "examples/toy/env.py").resolve()


def test_train_takes_a_config_or_resume_but_not_both_nor_neither(tmp_path: Path) -> None:
    for args in ((), (str(ROOT / "examples/toy/config.yaml"), "--resume", str(tmp_path))):
        result = _lockgate("train", *args)
        assert result.returncode == 2 and "exactly one" in result.stderr, result.stderr
    result = _lockgate("train", "--resume", str(tmp_path / "no-run"))
    assert result.returncode == 2 and "not found" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_saved_run_config_loads_back_for_resume_with_overrides(tmp_path: Path) -> None:
    config = load_config(ROOT / "examples/toy/config.yaml")
    (tmp_path / "config.json").write_text(config.model_dump_json(indent=2))
    again = load_config(tmp_path / "config.json", ["loop.steps=40"])
    assert again.loop.steps == 40
    assert again.model_dump(exclude={"loop"}) == config.model_dump(exclude={"loop"})
    assert again.environment.path == (ROOT / "examples/toy/env.py").resolve()
