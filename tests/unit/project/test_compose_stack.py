"""docker-compose.yml and its GPU override, checked without running anything: Docker's own
parser (Debian's docker-compose, which scripts/test.sh installs; skipped without it) renders
what a user's .env selects, the .env example, the trainer's healthcheck rule, and the
substitution tests/support/compose_local.py does as compose does (its services run as local
processes: tests/vllm/ and tests/integration/test_compose_stack.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from lockgate.coordinator.config import RunConfig, apply_overrides, env_overrides
from lockgate.coordinator.launch import placement
from lockgate.coordinator.launch.parts import replica_launch_config_of
from lockgate.coordinator.launch.placement import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GpuRequest,
    Placement,
    colocated_utilization,
)
from lockgate.coordinator.launch.replicas import replica_command
from tests.support.compose_local import (
    ComposeError,
    LocalMap,
    healthcheck_argv,
    interpolate,
    load_compose,
    read_env_file,
    services_of,
    start_order,
)

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
RL_GPU = ROOT / "examples" / "deepresearch" / "configs" / "rl_gpu.yaml"
TOKEN = "admin-token-for-the-compose-test"
GPU_FILES = "COMPOSE_FILE=docker-compose.yml:docker-compose.gpu.yml"
# Qwen3-1.7B's parameter count (its published config.json, tied embeddings, counted with
# transformers on the meta device), the model the one-GPU memory split is figured for.
QWEN3_1_7B_PARAMS = 1_720_574_976
GIB = 1 << 30


def documented_variables(path: Path) -> dict[str, str]:
    """The variables .env.example names, set or shown commented out (`# NAME=default`)."""
    found = re.findall(r"^(?:# )?([A-Z][A-Z0-9_]*)=(.*)$", path.read_text(), re.M)
    return dict(found)


def _env_file(tmp_path: Path, *lines: str) -> Path:
    """A user's .env holding `lines` only (KEY=value)."""
    path = tmp_path / ".env"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def _docker_compose(env_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Debian's docker-compose in the repository (so COMPOSE_FILE in the .env picks the files,
    as it does for a user), reading `env_file` as the .env."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("no docker-compose (scripts/test.sh installs Debian's package)")
    # The shell's variables win over the .env file in compose: none of ours may leak in.
    ours = {*documented_variables(ENV_EXAMPLE), "COMPOSE_PROFILES"}
    env = {k: v for k, v in os.environ.items() if k not in ours}
    return subprocess.run(
        [exe, "--env-file", str(env_file), *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip


def _rendered(env_file: Path) -> dict[str, Any]:
    result = _docker_compose(env_file, "config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]  # type: ignore[no-any-return]


def _devices(spec: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = spec.get("deploy", {}).get("resources", {}).get("reservations", {})
    return reservations.get("devices", [])  # type: ignore[no-any-return]


def test_the_default_with_only_the_token_is_the_cpu_stack(tmp_path: Path) -> None:
    services = _rendered(_env_file(tmp_path, f"LOCKGATE_ADMIN_TOKEN={TOKEN}"))
    started = {name for name, spec in services.items() if not spec.get("profiles")}
    assert started == {"replica", "gateway", "trainer"}
    assert services["retrieval"]["profiles"] == ["deepresearch"]
    for name, spec in services.items():
        assert spec["image"] == "lockgate:cpu", name
        assert spec["build"]["dockerfile"] == "Dockerfile", name
        assert _devices(spec) == [], name
    trainer = services["trainer"]
    assert trainer["command"].split()[:3] == ["lockgate", "train", "examples/toy/config.yaml"]
    assert trainer["environment"]["LOCKGATE_MODEL__PATH"] == ""  # the image's tiny model
    assert trainer["environment"]["LOCKGATE_LOOP__STEPS"] == "30"
    assert services["gateway"]["ports"] in (
        ["127.0.0.1:8000:8000/tcp"],
        [{"host_ip": "127.0.0.1", "published": 8000, "target": 8000, "protocol": "tcp"}],
    )


def _gpu_stack(tmp_path: Path, *lines: str) -> dict[str, Any]:
    env_file = _env_file(
        tmp_path, f"LOCKGATE_ADMIN_TOKEN={TOKEN}", GPU_FILES, "MODEL_PATH=/models/m", *lines
    )
    return _rendered(env_file)


def _config_of(spec: dict[str, Any]) -> RunConfig:
    """The run config a service's lockgate reads from its rendered environment."""
    return RunConfig.model_validate(apply_overrides({}, env_overrides(spec["environment"])))


def _gpu_plans(
    services: dict[str, Any], gpus_on_machine: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Placement, Placement, list[str]]:
    """What the launcher makes of the rendered settings inside each container, on a machine of
    80 GiB GPUs serving Qwen3-1.7B: the replica's placement on the one GPU it is given and its
    vLLM command, the trainer's placement on every GPU (its `count: all`)."""
    replica, trainer = services["replica"], services["trainer"]
    assert [d.get("device_ids") for d in _devices(replica)] == [["0"]]
    assert [d.get("count") for d in _devices(trainer)] == ["all"]
    monkeypatch.setattr(placement, "smallest_gpu_bytes", lambda count: 80 * GIB)
    monkeypatch.setattr(placement, "param_count", lambda model_dir: QWEN3_1_7B_PARAMS)
    model_dir = Path("/models/m")
    monkeypatch.setattr(placement, "visible_gpus", lambda: ["0"])
    config = _config_of(replica)
    replica_placement = placement.placement_here(
        config, model_dir, replicas_here=config.replicas.count, trainer_ranks=0
    )
    launch = replica_launch_config_of(config, model_dir, Path("/logs"), replica_placement)
    argv = replica_command(launch, "0.0.0.0", 8001)
    monkeypatch.setattr(placement, "visible_gpus", lambda: [str(i) for i in range(gpus_on_machine)])
    config = _config_of(trainer)
    trainer_placement = placement.placement_here(
        config, model_dir, replicas_here=0, trainer_ranks=config.trainer.world_size
    )
    return replica_placement, trainer_placement, argv


def _gpus(placed: Placement) -> tuple[list[list[str]], list[str], float]:
    assert placed.gpus is not None
    return placed.gpus.replica_gpus, placed.gpus.trainer_gpus, placed.gpus.gpu_memory_utilization


def test_the_gpu_stack_shares_one_gpu_by_default_with_the_placement_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _gpu_stack(tmp_path)
    assert {name for name, s in services.items() if not s.get("profiles")} == {
        "replica",
        "gateway",
        "trainer",
    }
    assert {spec["image"] for spec in services.values()} == {"lockgate:gpu"}
    for name in ("replica", "gateway", "trainer"):
        assert services[name]["environment"]["LOCKGATE_MODEL__PATH"] == "/models/m"
    replica, trainer, argv = _gpu_plans(services, 1, monkeypatch)
    assert replica.replica_device == trainer.trainer_device == "cuda"
    assert _gpus(replica)[0] == [["0"]] and _gpus(trainer)[1] == ["0"]
    # The share the plan gives a replica beside a trainer rank of the model on an 80 GiB GPU.
    shared = colocated_utilization(
        GpuRequest(
            visible=["0"],
            gpu_bytes=80 * GIB,
            replicas=1,
            tensor_parallel_size=1,
            trainer_ranks=1,
            param_count=QWEN3_1_7B_PARAMS,
        )
    )
    assert shared == 0.62
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(shared)


def test_more_gpus_with_one_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, trainer, argv = _gpu_plans(_gpu_stack(tmp_path, "GPUS=2"), 2, monkeypatch)
    assert _gpus(replica)[0] == [["0"]] and _gpus(trainer)[1] == ["1"]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(DEFAULT_GPU_MEMORY_UTILIZATION)
    replica, trainer, argv = _gpu_plans(_gpu_stack(tmp_path, "GPUS=3"), 3, monkeypatch)
    assert _gpus(replica)[0] == [["0"]] and _gpus(trainer)[1] == ["1", "2"]
    result = _docker_compose(
        _env_file(tmp_path, f"LOCKGATE_ADMIN_TOKEN={TOKEN}", GPU_FILES, "MODEL_PATH=/m", "GPUS=9"),
        "config",
        "-q",
    )
    assert result.returncode != 0 and "gpus-9" in result.stderr


def test_the_gpu_stack_asks_for_a_model(tmp_path: Path) -> None:
    result = _docker_compose(
        _env_file(tmp_path, f"LOCKGATE_ADMIN_TOKEN={TOKEN}", GPU_FILES), "config", "-q"
    )
    assert result.returncode != 0
    assert "set MODEL_PATH in .env for the GPU stack" in result.stderr


def test_docker_compose_refuses_to_run_without_an_admin_token() -> None:
    # .env.example as shipped: the token is empty, and no default is baked in.
    result = _docker_compose(ENV_EXAMPLE, "config", "-q")
    assert result.returncode != 0
    assert "set LOCKGATE_ADMIN_TOKEN in .env" in result.stderr


def test_the_env_example_sets_only_the_token_and_names_every_variable() -> None:
    set_lines = read_env_file(ENV_EXAMPLE)
    assert set_lines == {"LOCKGATE_ADMIN_TOKEN": ""}
    documented = documented_variables(ENV_EXAMPLE)
    used = set()
    for path in (COMPOSE, COMPOSE_GPU):
        used |= set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    assert used - set(documented) == set()
    assert documented["COMPOSE_FILE"] == GPU_FILES.split("=", 1)[1]
    with pytest.raises(ComposeError, match="set LOCKGATE_ADMIN_TOKEN"):
        load_compose(COMPOSE, {})
    compose = load_compose(COMPOSE, {"LOCKGATE_ADMIN_TOKEN": TOKEN})
    published = {
        name: spec["ports"] for name, spec in compose["services"].items() if spec.get("ports")
    }
    assert published == {"gateway": ["127.0.0.1:8000:8000"]}
    assert start_order(services_of(compose, set())) == ["replica", "gateway", "trainer"]


def test_every_documented_exit_code_from_names_the_trainer() -> None:
    compose = load_compose(COMPOSE, {"LOCKGATE_ADMIN_TOKEN": TOKEN})
    named = []
    for doc in (DEPLOY_DOC, ROOT / "README.md", COMPOSE, COMPOSE_GPU):
        named += re.findall(r"--exit-code-from\s+([\w-]+)", doc.read_text())
    assert named and set(named) == {"trainer"}
    assert "trainer" in compose["services"]


def test_the_deepresearch_gpu_path_matches_rl_gpu_yaml() -> None:
    """docs/deploy.md's DeepResearch GPU settings: the corpus file rl_gpu.yaml reads, and a
    GPU count whose trainer.env gives the config's trainer ranks."""
    recipe = yaml.safe_load(RL_GPU.read_text())
    section = DEPLOY_DOC.read_text().split("## docker-compose", 1)[1].split("\n## ", 1)[0]
    corpus = Path(recipe["environment"]["args"]["corpus"])
    assert corpus.parent == Path("/data/deepresearch")  # where DEEPRESEARCH_DATA is mounted
    assert f"RETRIEVAL_CORPUS={corpus.name}" in section
    assert f"TRAIN_CONFIG={RL_GPU.relative_to(ROOT)}" in section
    gpus = re.findall(r"\bGPUS=(\d+)", section.split("The DeepResearch example", 1)[1])
    assert len(set(gpus)) == 1
    trainer_env = read_env_file(ROOT / "compose" / f"gpus-{gpus[0]}" / "trainer.env")
    assert int(trainer_env["LOCKGATE_TRAINER__WORLD_SIZE"]) == recipe["trainer"]["world_size"]
    assert len(yaml.safe_load(trainer_env["LOCKGATE_TRAINER__GPUS"])) == recipe["trainer"]["world_size"]  # fmt: skip


def _trainer_health(run_dir: Path) -> list[str]:
    compose = load_compose(COMPOSE, {"LOCKGATE_ADMIN_TOKEN": TOKEN})
    argv = healthcheck_argv(
        compose["services"]["trainer"], LocalMap(paths={"/data/runs/train": run_dir})
    )
    assert argv is not None
    return argv


def _healthy(argv: list[str]) -> bool:
    return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0


def test_the_trainer_healthcheck_is_not_satisfied_by_a_previous_runs_files(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "runs" / "train"
    run_dir.mkdir(parents=True)
    health = _trainer_health(run_dir)
    config = run_dir / "config.json"
    config.write_text("{}")  # a previous run's, and no run now
    assert not _healthy(health)
    # A process that runs `lockgate train` on this run dir, as the container's does.
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    proc = subprocess.Popen([*sleeper, "train", "cfg.yaml", "--run-dir", str(run_dir)])
    other = subprocess.Popen([*sleeper, "train", "cfg.yaml", "--run-dir", str(tmp_path / "x")])
    try:
        time.sleep(0.5)
        old = time.time() - 3600
        os.utime(config, (old, old))
        assert not _healthy(health)  # the config.json predates the process
        config.write_text("{}")  # this run's
        assert _healthy(health)
        proc.kill()
        proc.wait()
        assert not _healthy(health)  # another run dir's process is not this run
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()
    config.unlink()
    assert not _healthy(health)


def test_substitution_follows_compose() -> None:
    env = {"A": "a", "EMPTY": ""}
    assert interpolate("${A}-${A:-x}-${EMPTY:-d}-${EMPTY-d}-${NONE-n}-$A-$$A", env) == (
        "a-a-d--n-a-$A"
    )
    with pytest.raises(ComposeError, match="NONE: needed"):
        interpolate("${NONE:?needed}", env)
    with pytest.raises(ComposeError, match="EMPTY: needed"):
        interpolate("${EMPTY:?needed}", env)


def _local_env(tmp_path: Path, marker: str, tiny_model_dir: Path) -> dict[str, str]:
    """What the image sets around the services' own environment (Dockerfile's ENV)."""
    name, value = marker.split("=")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "LOCKGATE_CACHE": str(tiny_model_dir.parent),  # the image's tiny model
        "HF_HUB_OFFLINE": "1",
        "HOME": str(tmp_path / "home"),
        name: value,
    }
