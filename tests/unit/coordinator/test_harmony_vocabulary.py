"""A run in the gpt-oss format points openai-harmony at the vocabulary scripts/setup.sh made
(for its own process and those it starts, the gateway's included), and without one it is a
one-line config error naming the setup step rather than a download attempt at run time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.errors import ConfigError
from lockgate.coordinator.launch.parts import chat_format_of, gateway_config_of
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.harmony_vocab import ENCODINGS_ENV, o200k_dir, require_o200k


def _run_config(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate(
        {"name": "t", "run_dir": str(tmp_path / "run"), "environment": {"path": "env.py"}}
    )


@pytest.fixture(scope="module")
def gpt_oss_dir() -> Path:
    require_o200k()
    return ensure_tiny_model(spec=family_spec("gpt-oss"))


def test_a_gpt_oss_run_points_harmony_at_setups_vocabulary(
    tmp_path: Path, gpt_oss_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENCODINGS_ENV, raising=False)
    config = gateway_config_of(_run_config(tmp_path), gpt_oss_dir, [], tmp_path, "x" * 8)
    assert config.renderer == "gpt-oss"
    assert os.environ[ENCODINGS_ENV] == str(o200k_dir())


def test_a_gpt_oss_run_without_the_vocabulary_is_one_config_error(
    tmp_path: Path, gpt_oss_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENCODINGS_ENV, raising=False)
    monkeypatch.setenv("LOCKGATE_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as error:
        chat_format_of(_run_config(tmp_path), gpt_oss_dir)
    message = str(error.value)
    assert message.startswith("model.chat_format gpt-oss: the gpt-oss (harmony) format needs")
    assert "run scripts/setup.sh" in message and "\n" not in message
