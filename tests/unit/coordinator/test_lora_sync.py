"""The loop's weight sync with `model.lora` (issue 46), against in-memory gateways and trainer:
each sync has the gateway load the step's adapter (pause, load, resume, as a full sync), the
trainer is never asked for a snapshot layout, a resumed run has the replicas take the resumed
step's adapter before any session starts, and a validation round validates the adapter of the
version it names; the gateway configs carry the run's adapter name, the validation gateway its
own."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from lockgate.coordinator.config import LoopSection, RunConfig
from lockgate.coordinator.launch import local
from lockgate.coordinator.launch.parts import adapter_name, gateway_config_of
from lockgate.coordinator.loop.state import LoopState, load_state, truncate_steps
from lockgate.coordinator.loop.training import TrainingLoop, Validation
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import read_metrics
from lockgate.gateway.schema import CreatedSession, LoadReport
from lockgate.trainer.tiny_models.builder import ensure_tiny_model
from tests.unit.coordinator.test_loop_resume_logic import FakeEnv, FakeGateway, FakeTrainer


class AdapterGateway(FakeGateway):
    """A gateway in adapter mode: weights arrive as adapters, never as snapshots."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters: list[tuple[str, int]] = []

    async def create_session(self, *args: object, **kwargs: object) -> CreatedSession:
        self.sync_calls.append("session")
        return await super().create_session(*args, **kwargs)  # type: ignore[arg-type]

    async def load_adapter(self, path: str, version: int) -> LoadReport:
        self.adapters.append((path, version))
        self.sync_calls.append(f"adapter {version}")
        return LoadReport(version=version, loaded=["r"], failed={}, load_s=0.0)

    async def load_weights(self, path: str, version: int) -> LoadReport:
        raise AssertionError("a LoRA run never loads a full snapshot")

    async def resume(self, version: int) -> None:
        self.sync_calls.append(f"resume {version}")
        await super().resume(version)


def _loop(
    tmp_path: Path,
    steps: int,
    resume: LoopState | None = None,
    validation: Validation | None = None,
    val_every: int = 0,
) -> tuple[TrainingLoop, AdapterGateway]:
    gateway = AdapterGateway()
    config = LoopSection(
        steps=steps, groups_per_step=2, group_size=2, max_staleness=1, val_every=val_every
    )
    metrics = MetricsLog(tmp_path / "metrics.jsonl", steps, stream=io.StringIO())
    loop = TrainingLoop(
        config, FakeEnv(gateway, 0), gateway, FakeTrainer(tmp_path / "metrics.jsonl"),  # type: ignore[arg-type]
        metrics, state_path=RunDir(tmp_path).loop_state, resume=resume, validation=validation,
        adapters=True,
    )  # fmt: skip
    return loop, gateway


def test_each_sync_loads_the_steps_adapter_between_pause_and_resume(tmp_path: Path) -> None:
    loop, gateway = _loop(tmp_path, steps=3)
    summary = asyncio.run(loop.run())
    assert summary.version == 3
    # FakeTrainer publishes step k's weights at /w/k: each is loaded as version k.
    assert gateway.adapters == [("/w/1", 1), ("/w/2", 2), ("/w/3", 3)]
    # One sync at a time, each as a full one: pause, load, resume.
    syncs = [c for c in gateway.sync_calls if c != "session"]
    assert syncs == [c for v in (1, 2, 3) for c in ("pause", f"adapter {v}", f"resume {v}")]
    assert gateway.layout_calls == 0 and loop.trainer.layouts == []  # type: ignore[attr-defined]
    assert [r["version"] for r in read_metrics(tmp_path / "metrics.jsonl")][-1] == 3


def test_a_resumed_lora_run_loads_the_resumed_adapter_before_any_session(tmp_path: Path) -> None:
    first, _ = _loop(tmp_path, steps=3)
    asyncio.run(first.run())
    truncate_steps(RunDir(tmp_path).loop_state, 2)  # as if killed after step 2's checkpoint
    resumed, gateway = _loop(tmp_path, steps=4, resume=load_state(RunDir(tmp_path).loop_state, 2))
    asyncio.run(resumed.run())
    # FakeTrainer re-exports the checkpoint's step at /weights/step_2.
    assert gateway.adapters[0] == ("/weights/step_2", 2)
    assert gateway.sync_calls[:3] == ["pause", "adapter 2", "resume 2"]
    assert gateway.sync_calls.index("session") > 2
    assert [v for _, v in gateway.adapters] == [2, 3, 4]


def test_a_validation_round_first_brings_its_gateway_to_the_versions_adapter(
    tmp_path: Path,
) -> None:
    val_gateway = AdapterGateway()
    tasks = FakeEnv(val_gateway, 0).tasks[:2]
    validation = Validation(val_gateway, tasks)  # type: ignore[arg-type]
    loop, gateway = _loop(tmp_path, steps=2, validation=validation, val_every=1)
    asyncio.run(loop.run())
    # Round 1 at the start validates the base model (version 0): nothing to load. Round 2,
    # after step 1's sync, loads the same adapter the training gateway loaded, as version 1.
    assert val_gateway.adapters == [("/w/1", 1)]
    assert val_gateway.sync_calls[:1] == ["session"]
    at = val_gateway.sync_calls.index("pause")
    assert val_gateway.sync_calls[at : at + 3] == ["pause", "adapter 1", "resume 1"]
    assert all(c == "session" for c in val_gateway.sync_calls[at + 3 :])
    assert validation.version == 1
    assert ("/w/1", 1) in gateway.adapters


def test_the_gateways_of_a_lora_run_name_their_adapters(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"model": {"lora": {"rank": 8}}})
    run_dir = tmp_path / "toy"
    model_dir = ensure_tiny_model()
    training = gateway_config_of(config, model_dir, ["http://r:1"], run_dir, "token-123456")
    assert training.adapter is not None
    launch = training.adapter.name.rsplit("-", 1)[1]
    assert training.adapter.name == adapter_name(run_dir, launch)
    val = local._validation_gateway(training, run_dir, "127.0.0.1").config
    assert val.adapter is not None and val.adapter.name == f"{training.adapter.name}-val"
    again = gateway_config_of(config, model_dir, ["http://r:1"], run_dir, "token-123456")
    assert again.adapter is not None and again.adapter.name != training.adapter.name
    full = gateway_config_of(RunConfig(), model_dir, ["http://r:1"], run_dir, "token-123456")
    assert full.adapter is None
    assert local._validation_gateway(full, run_dir, "127.0.0.1").config.adapter is None
