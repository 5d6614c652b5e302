"""The replicas' command lines per device, and the GPU placement plan of one node: pure
functions, checked without a GPU (none of this project's machines has one; docs/deploy.md,
"GPUs", says what a GPU machine would check)."""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from pathlib import Path

import pytest

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch import local
from lockgate.coordinator.launch import placement as placement_module
from lockgate.coordinator.launch import trainer as trainer_launch
from lockgate.coordinator.launch.deploy_checks import DeployError
from lockgate.coordinator.launch.parts import replica_launch_config_of
from lockgate.coordinator.launch.placement import (
    CPU_ONLY,
    GpuRequest,
    Placement,
    param_count,
    placement_here,
    placement_lines,
    plan_gpus,
)
from lockgate.coordinator.launch.replicas import (
    KEEP_FREED_MEMORY,
    ReplicaLaunchConfig,
    replica_command,
    replica_environment,
    xgrammar_cache_environment,
)
from lockgate.gateway.sync.weights import SNAPSHOT_LOAD_EXTENSION
from lockgate.gateway.vllm_ext.routes import REPLICA_ROUTES
from lockgate.trainer.config import TrainerConfig

GIB = 1 << 30
CPU_ONLY_VARS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", *KEEP_FREED_MEMORY)


def _launch(tmp_path: Path, placement: Placement, **sets: object) -> ReplicaLaunchConfig:
    config = RunConfig.model_validate({"replicas": sets})
    return replica_launch_config_of(config, tmp_path, tmp_path / "logs", placement)


def test_a_cpu_replica_runs_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    c = _launch(tmp_path, CPU_ONLY, kv_cache_gib=3, max_model_len=2048)
    assert replica_command(c, "127.0.0.1", 8000) == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enable-scale-out",
        "--worker-extension-cls",
        SNAPSHOT_LOAD_EXTENSION,
        "--middleware",
        REPLICA_ROUTES,
        "--enforce-eager",  # the suite's vLLM is the CPU build
    ]
    env = replica_environment(c, "1")
    ours = {k: v for k, v in env.items() if k not in os.environ}
    assert ours == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "3",
        "VLLM_CPU_OMP_THREADS_BIND": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **KEEP_FREED_MEMORY,
        # xgrammar 0.2.8's cache off, for forced calls' heads held to tokens (issue 43).
        **xgrammar_cache_environment(),
    }
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # inherited, not set


def test_a_cuda_replica_gets_its_gpus_and_no_cpu_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    for name in CPU_ONLY_VARS:
        monkeypatch.delenv(name, raising=False)
    plan = plan_gpus(_request(visible=["0", "1", "2", "3"], replicas=1, tp=2, ranks=2))
    c = _launch(
        tmp_path,
        Placement("cuda", "cuda", plan),
        count=1,
        tensor_parallel_size=2,
        max_num_seqs=64,
        enforce_eager=False,
    )
    argv = replica_command(c, "0.0.0.0", 8001)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert "--enforce-eager" not in argv
    assert c.gpus is not None
    env = replica_environment(c, "0", c.gpus[0])
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert not [k for k in CPU_ONLY_VARS if k in env]
    # On Ray the actor's own CUDA_VISIBLE_DEVICES (Ray's assignment) is inherited.
    assert replica_environment(c, "0")["CUDA_VISIBLE_DEVICES"] == "7"


def test_an_explicit_dtype_wins(tmp_path: Path) -> None:
    assert _launch(tmp_path, CPU_ONLY, dtype="bfloat16").dtype == "bfloat16"
    plan = plan_gpus(_request(visible=["0", "1"], replicas=1, ranks=1))
    assert (
        _launch(tmp_path, Placement("cuda", "cuda", plan), count=1, dtype="float16").dtype
        == "float16"
    )


def _request(
    *,
    visible: list[str],
    replicas: int,
    ranks: int,
    tp: int = 1,
    gib: int = 80,
    params: int = 500_000_000,
    **kwargs: object,
) -> GpuRequest:
    return GpuRequest(
        visible=visible,
        gpu_bytes=gib * GIB,
        replicas=replicas,
        tensor_parallel_size=tp,
        trainer_ranks=ranks,
        param_count=params,
        **kwargs,  # type: ignore[arg-type]
    )


def _ids(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def test_one_gpu_is_shared_with_the_memory_split() -> None:
    plan = plan_gpus(_request(visible=["0"], replicas=1, ranks=1))
    assert plan.colocated
    assert plan.replica_gpus == [["0"]] and plan.trainer_gpus == ["0"]
    # 1 - (0.5e9 x 16 B + 4 GiB) / 80 GiB = 0.857.., rounded down to the hundredth.
    assert plan.gpu_memory_utilization == 0.85


def test_two_gpus_split_replica_first() -> None:
    plan = plan_gpus(_request(visible=_ids(2), replicas=1, ranks=1))
    assert not plan.colocated
    assert plan.replica_gpus == [["0"]] and plan.trainer_gpus == ["1"]
    assert plan.gpu_memory_utilization == 0.9


def test_four_gpus_keep_tensor_parallel_groups_aligned() -> None:
    plan = plan_gpus(_request(visible=_ids(4), replicas=1, tp=2, ranks=2))
    assert plan.replica_gpus == [["0", "1"]] and plan.trainer_gpus == ["2", "3"]
    plan = plan_gpus(_request(visible=_ids(4), replicas=2, ranks=1))
    assert plan.replica_gpus == [["0"], ["1"]] and plan.trainer_gpus == ["2"]
    assert plan.unused == ["3"]


def test_eight_gpus() -> None:
    plan = plan_gpus(_request(visible=_ids(8), replicas=2, tp=2, ranks=4))
    assert plan.replica_gpus == [["0", "1"], ["2", "3"]]
    assert plan.trainer_gpus == ["4", "5", "6", "7"]
    assert plan.lines()[0] == "replica 0: GPU 0,1 (gpu_memory_utilization 0.9)"
    assert plan.lines()[-1] == "trainer rank 3: GPU 7"


def test_plans_name_the_gpus_this_process_sees() -> None:
    # Under CUDA_VISIBLE_DEVICES=4,5 a child must be given 4 or 5, not 0 or 1.
    plan = plan_gpus(_request(visible=["4", "5"], replicas=1, ranks=1))
    assert plan.replica_gpus == [["4"]] and plan.trainer_gpus == ["5"]


def test_colocation_when_asked_shares_each_gpu_with_one_rank() -> None:
    plan = plan_gpus(_request(visible=_ids(4), replicas=2, ranks=2, colocate=True))
    assert plan.colocated and plan.replica_gpus == [["0"], ["1"]]
    assert plan.trainer_gpus == ["0", "1"] and plan.unused == ["2", "3"]
    # The Adam states are sharded over both ranks: more room for the replicas.
    assert plan.gpu_memory_utilization == 0.9
    with pytest.raises(DeployError, match=r"must equal trainer.world_size \(1\)"):
        plan_gpus(_request(visible=_ids(2), replicas=2, ranks=1, colocate=True))


def test_a_model_too_large_to_share_one_gpu_is_a_one_line_error() -> None:
    with pytest.raises(DeployError) as caught:
        plan_gpus(_request(visible=["0"], replicas=1, ranks=1, params=7_000_000_000))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("replicas.colocate: a trainer rank (108.3 GiB")
    assert "do not fit on one 80.0 GiB GPU" in message


def test_an_explicit_utilization_that_starves_the_trainer_is_refused() -> None:
    with pytest.raises(DeployError, match=re.escape("at most 0.85 fits")):
        plan_gpus(_request(visible=["0"], replicas=1, ranks=1, gpu_memory_utilization=0.9))
    plan = plan_gpus(_request(visible=["0"], replicas=1, ranks=1, gpu_memory_utilization=0.5))
    assert plan.gpu_memory_utilization == 0.5


def test_too_few_gpus_for_the_split_is_a_one_line_error() -> None:
    with pytest.raises(DeployError) as caught:
        plan_gpus(_request(visible=_ids(2), replicas=2, ranks=1))
    assert str(caught.value) == (
        "replicas.count: 2 replicas x tensor_parallel_size 1 + 1 trainer ranks need 3 GPUs, "
        "2 visible: ask for fewer, or share GPUs with replicas.colocate: true"
    )
    with pytest.raises(DeployError, match=r"need 2 GPUs, 1 visible: ask for fewer$"):
        plan_gpus(_request(visible=["0"], replicas=2, ranks=0))  # `lockgate replicas`
    with pytest.raises(DeployError, match="no GPU is visible"):
        plan_gpus(_request(visible=[], replicas=1, ranks=0))


def test_explicit_gpus_are_taken_and_checked() -> None:
    plan = plan_gpus(
        _request(visible=_ids(4), replicas=1, ranks=2, replica_gpus=[3], trainer_gpus=[0, 1])
    )
    assert plan.replica_gpus == [["3"]] and plan.trainer_gpus == ["0", "1"]
    plan = plan_gpus(_request(visible=_ids(4), replicas=1, ranks=1, replica_gpus=[2]))
    assert plan.trainer_gpus == ["0"]
    with pytest.raises(DeployError, match=re.escape("trainer.gpus: GPU 1 is in replicas.gpus too")):
        plan_gpus(
            _request(visible=_ids(4), replicas=2, ranks=1, replica_gpus=[0, 1], trainer_gpus=[1])
        )
    with pytest.raises(
        DeployError, match=re.escape("replicas.gpus: GPU 4 is not among the 4 visible")
    ):
        plan_gpus(_request(visible=_ids(4), replicas=1, ranks=1, replica_gpus=[4]))
    with pytest.raises(
        DeployError, match=re.escape("replicas.gpus: lists 1 GPUs, but 2 are needed")
    ):
        plan_gpus(_request(visible=_ids(4), replicas=1, tp=2, ranks=1, replica_gpus=[0]))


def test_replicas_alone_take_the_first_gpus() -> None:
    plan = plan_gpus(_request(visible=_ids(2), replicas=2, ranks=0))
    assert plan.replica_gpus == [["0"], ["1"]] and plan.trainer_gpus == []


def _fake_model(directory: Path, shapes: dict[str, list[int]]) -> Path:
    header = json.dumps(
        {name: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for name, s in shapes.items()}
        | {"__metadata__": {"format": "pt"}}
    ).encode()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


def test_the_parameter_count_comes_from_the_safetensors_headers(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m", {"a": [1000, 64], "b": [64]})
    assert param_count(model) == 64_064


def test_a_cpu_machine_plans_nothing_and_prints_nothing(tmp_path: Path) -> None:
    config = RunConfig()
    placement = placement_here(config, tmp_path, replicas_here=2, trainer_ranks=1)
    assert placement == CPU_ONLY and placement_lines(placement) == []


def test_this_nodes_gpus_go_into_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_module, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(placement_module, "smallest_gpu_bytes", lambda n: 80 * GIB)
    model = _fake_model(tmp_path / "m", {"w": [500_000, 1000]})
    config = RunConfig.model_validate({"replicas": {"count": 1, "device": "cuda"}})
    placement = placement_here(config, model, replicas_here=1, trainer_ranks=1)
    assert placement.replica_device == placement.trainer_device == "cuda"
    assert placement.gpus is not None and placement.gpus.colocated
    assert placement_lines(placement) == [
        "placement: replicas on cuda, trainer on cuda",
        "  replica 0: GPU 0 (gpu_memory_utilization 0.85)",
        "  trainer rank 0: GPU 0 (shared with the replicas)",
    ]
    # auto: the CPU build of vLLM cannot use the GPU; the trainer takes it alone.
    auto = RunConfig.model_validate({"replicas": {"count": 1}})
    placement = placement_here(auto, model, replicas_here=1, trainer_ranks=1)
    assert (placement.replica_device, placement.trainer_device) == ("cpu", "cuda")
    assert placement.gpus is not None and placement.gpus.trainer_gpus == ["0"]


def test_trainer_ranks_get_their_gpus_in_cuda_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(trainer_launch, "spawn", lambda cmd, log, env: seen.append(env))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    for gpus in (["2", "3"], None):
        trainer_launch.spawn_ranks(
            "m", [], world_size=2, num_threads=1, log_path=tmp_path / "log", gpus=gpus
        )
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "2,3"  # LOCAL_RANK r takes the r-th
    assert seen[1]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # a CPU run's environment, untouched


def test_a_run_plans_the_gpus_of_what_it_starts_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(placement_module, "visible_gpus", lambda: ["0", "1", "2"])
    monkeypatch.setattr(placement_module, "smallest_gpu_bytes", lambda n: 80 * GIB)
    model = _fake_model(tmp_path / "m", {"w": [1000, 1000]})
    trainer = TrainerConfig(model_dir=model, world_size=2)
    config = RunConfig.model_validate({"replicas": {"count": 1, "device": "cuda"}})
    placement = local._placement(config, None, model, trainer, None)
    assert placement.gpus is not None
    assert placement.gpus.replica_gpus == [["0"]] and placement.gpus.trainer_gpus == ["1", "2"]
    assert "[lockgate]   trainer rank 1: GPU 2" in capsys.readouterr().err
    # Replicas given by URL run elsewhere: the trainer's ranks alone take this node's GPUs.
    given = RunConfig.model_validate({"replicas": ["http://10.0.0.2:8001"]})
    placement = local._placement(given, None, model, trainer, None)
    assert placement.gpus is not None and placement.gpus.trainer_gpus == ["0", "1"]
    assert placement.gpus.replica_gpus == []
