"""`model.lora` in the run config (issue 46): validated once, and handed to every part that needs
it: the trainer's config, the replicas' command line and environment (vLLM's LoRA flags, the
rank rounded up to one vLLM accepts), and a name for the run's adapters unique per run dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate.coordinator.cli.options import load_run_config
from lockgate.coordinator.config import VLLM_LORA_RANKS, RunConfig, vllm_lora_rank
from lockgate.coordinator.errors import ConfigError
from lockgate.coordinator.launch import local
from lockgate.coordinator.launch.parts import adapter_name, replica_launch_config_of
from lockgate.coordinator.launch.placement import CPU_ONLY
from lockgate.coordinator.launch.replicas import (
    RUNTIME_LORA_ENV,
    ReplicaLaunchConfig,
    replica_command,
    replica_environment,
)
from lockgate.trainer.config import LoraSpec


def _config(**sections: object) -> RunConfig:
    return RunConfig.model_validate(sections)


def _replicas(config: RunConfig, tmp_path: Path) -> ReplicaLaunchConfig:
    return replica_launch_config_of(config, tmp_path, tmp_path / "logs", CPU_ONLY)


@pytest.mark.parametrize(
    ("rank", "served"), [(1, 8), (8, 8), (9, 16), (16, 16), (33, 64), (300, 320), (512, 512)]
)
def test_the_replicas_rank_is_the_adapters_rounded_up_to_one_vllm_accepts(
    rank: int, served: int
) -> None:
    assert vllm_lora_rank(rank) == served
    assert served in VLLM_LORA_RANKS


def test_a_rank_above_what_vllm_serves_is_refused_in_the_config() -> None:
    with pytest.raises(ValueError, match="rank 513 is above the largest rank vLLM serves"):
        _config(model={"lora": {"rank": 513}})


def test_lora_with_the_collective_transport_is_one_line_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_run_config(None, ["model.lora.rank=8", "sync.transport=collective"])
    message = str(refused.value)
    assert "model.lora with sync.transport: collective is not built" in message
    assert len(message.strip().splitlines()) == 1


def test_lora_refuses_staging_a_snapshot_it_does_not_write() -> None:
    with pytest.raises(ValueError, match="nothing to stage"):
        _config(model={"lora": {}}, sync={"stage": True})


def test_lora_refuses_the_keep_pause_that_would_freeze_other_runs_calls() -> None:
    with pytest.raises(ValueError, match=r"sync\.mode: keep freezes calls"):
        _config(model={"lora": {}}, sync={"mode": "keep"})
    assert _config(model={"lora": {}}, sync={"mode": "drain"}).sync.mode == "drain"


def test_the_trainer_section_takes_no_lora_of_its_own() -> None:
    with pytest.raises(ValueError, match=r"adapters are set in model\.lora"):
        _config(trainer={"lora": {"rank": 8}})
    assert "lora" not in _config().trainer.model_dump()


def test_the_trainer_gets_the_models_lora(tmp_path: Path) -> None:
    spec = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    trainer = local._trainer_config(_config(model={"lora": spec}), tmp_path, resume=False)
    assert trainer.lora == LoraSpec(**spec)  # type: ignore[arg-type]
    assert local._trainer_config(_config(), tmp_path, resume=False).lora is None


def test_lora_replicas_serve_with_lora_on_and_runtime_loading_allowed(tmp_path: Path) -> None:
    config = _config(model={"lora": {"rank": 12}}, replicas={"max_loras": 6})
    launch = _replicas(config, tmp_path)
    argv = replica_command(launch, "127.0.0.1", 8000)
    at = argv.index("--enable-lora")
    assert argv[at : at + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "6"]
    env = replica_environment(launch, "0")
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # The Ray launcher builds its replicas' command and environment from these same functions.
    assert RUNTIME_LORA_ENV.items() <= env.items()


def test_replicas_without_lora_get_no_lora_flag_nor_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    launch = _replicas(_config(), tmp_path)
    argv = replica_command(launch, "127.0.0.1", 8000)
    assert not [a for a in argv if a.startswith("--") and "lora" in a]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in replica_environment(launch, "0")
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        ReplicaLaunchConfig(model_dir=tmp_path, log_dir=tmp_path, max_lora_rank=12)


def test_adapter_names_tell_runs_and_their_starts_apart(tmp_path: Path) -> None:
    one, other = tmp_path / "a" / "toy", tmp_path / "b" / "toy"
    assert adapter_name(one, "1f2e") == adapter_name(tmp_path / "a" / "." / "toy", "1f2e")
    assert adapter_name(one, "1f2e") != adapter_name(other, "1f2e")
    # A resumed run (a new start) names its adapters anew.
    assert adapter_name(one, "1f2e") != adapter_name(one, "0b3c")
    assert adapter_name(one, "1f2e").startswith("toy-") and adapter_name(one, "1f2e").endswith(
        "-1f2e"
    )
    # Odd characters of a dir name do not reach the replicas' model names.
    odd = adapter_name(tmp_path / "my run@v1 (x)", "1f2e")
    assert odd.startswith("my-run-v1-x-") and "@" not in odd and " " not in odd
    assert adapter_name(tmp_path / "_hidden", "1f2e").startswith("hidden-")


def test_the_lora_example_loads_as_a_lora_run_of_the_toy_task() -> None:
    root = Path(__file__).resolve().parents[3]
    config = load_run_config(root / "examples/lora/config.yaml", [])
    assert config.model.lora is not None and config.model.lora.rank == 8
    assert "lm_head" in config.model.lora.target_modules
    assert config.environment.path == root / "examples/toy/env.py"
