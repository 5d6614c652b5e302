"""The deepresearch evaluation's gateway speaks the model's chat format, decided as a training
run decides it (examples/deepresearch/serving.py; issue 42): no process is started here, the
gateway's config is what is checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from lockgate.examples.deepresearch import serving
from lockgate.gateway.calls.chat_format import ChatFormatError
from lockgate.gateway.config import GatewayConfig
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec


class _Gateway:
    """Stands in for the gateway process: keeps the config it was given."""

    started: ClassVar[list[GatewayConfig]] = []

    def __init__(self, config: GatewayConfig, work_dir: Path) -> None:
        self.config, self.url = config, "http://gateway.invalid"

    def start(self) -> None:
        self.started.append(self.config)

    def stop(self) -> None:
        pass


class _Retrieval:
    url = "http://retrieval.invalid"

    @classmethod
    def external(cls, url: str) -> _Retrieval:
        return cls()

    def stop(self) -> None:
        pass


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> list[GatewayConfig]:
    monkeypatch.setattr(serving, "GatewayProcess", _Gateway)
    monkeypatch.setattr(serving, "RetrievalService", _Retrieval)
    _Gateway.started = []
    return _Gateway.started


def _serve(model_dir: Path, tmp_path: Path, **options: Any) -> None:
    with serving.serve_model(
        model_dir,
        tmp_path / "corpus.jsonl",
        tmp_path / "work",
        retrieval_url="http://retrieval.invalid",
        replica_urls=["http://replica.invalid"],
        **options,
    ):
        pass


@pytest.mark.parametrize(("family", "chat_format"), [("llama-3", "llama-3"), ("qwen3", "qwen3")])
def test_the_gateway_renders_in_the_format_read_from_the_model(
    family: str, chat_format: str, tmp_path: Path, no_processes: list[GatewayConfig]
) -> None:
    _serve(ensure_tiny_model(spec=family_spec(family)), tmp_path)
    assert [c.renderer for c in no_processes] == [chat_format]


def test_a_format_given_by_name_is_taken_and_an_unknown_one_refused_before_any_start(
    tmp_path: Path, no_processes: list[GatewayConfig]
) -> None:
    model = ensure_tiny_model(spec=family_spec("default"))
    _serve(model, tmp_path, chat_format="qwen3")
    assert [c.renderer for c in no_processes] == ["qwen3"]
    with pytest.raises(ChatFormatError, match="unknown chat format 'qwen'"):
        _serve(model, tmp_path, chat_format="qwen")
    assert len(no_processes) == 1
