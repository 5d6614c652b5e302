"""The validation gateway is waited for as long as the main gateway (`gateway.startup_timeout_s`):
it starts beside the main one on the same machine, loading the same model, and under load it
took longer than the fixed 60 s it once had (issue 44's compose run)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.local import _Parts, _wait_parts
from lockgate.trainer.config import TrainerConfig


@dataclass
class WaitedFor:
    """Stands for a started process: records how long it was waited for."""

    waits: list[float | None] = field(default_factory=list)
    url: str = "http://127.0.0.1:1"

    def wait_ready(self, timeout_s: float | None = None) -> None:
        self.waits.append(timeout_s)

    def resumed_step(self) -> int:
        return 0


def test_the_validation_gateway_gets_the_gateways_startup_timeout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = RunConfig.model_validate({"gateway": {"startup_timeout_s": 240}})
    val_gateway, trainer = WaitedFor(), WaitedFor()
    parts = _Parts(
        gateway_url="http://127.0.0.1:2",
        admin_token="t",
        gateway=None,  # a gateway given by URL: nothing of ours to wait for
        val_gateway=val_gateway,  # type: ignore[arg-type]
        trainer=trainer,  # type: ignore[arg-type]
    )
    trainer_config = TrainerConfig(model_dir=tiny_model_dir)
    with contextlib.ExitStack() as stack:
        state, rewards = _wait_parts(config, parts, tmp_path, trainer_config, stack, None)
    assert val_gateway.waits == [240.0]
    assert state is None and rewards == []
