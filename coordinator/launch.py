"""Bring up a whole run on this machine: replicas, gateway, trainer ranks, the loop; tear down.

The processes are started from the main thread (their death signal is tied to it) and stopped
in reverse order whatever happens: normal end, an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import secrets
import signal
import sys
from pathlib import Path
from types import FrameType

from lockgate.agent_runtime import CommandEnvironment, Environment
from lockgate.coordinator.config import EnvironmentSection, RunConfig
from lockgate.coordinator.gateway_process import GatewayProcess
from lockgate.coordinator.loop import RunSummary, TrainingLoop
from lockgate.coordinator.metrics import MetricsLog
from lockgate.coordinator.replica_launcher import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.coordinator.trainer_process import TrainerProcess
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.config import GatewayConfig
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.tiny_model import ensure_tiny_model

log = logging.getLogger(__name__)


def _say(message: str) -> None:
    print(f"[lockgate] {message}", file=sys.stderr, flush=True)


def load_environment(
    section: EnvironmentSection, model_dir: Path, log_dir: Path | None = None
) -> Environment:
    """The run's environment: a CommandEnvironment for `command`, else the Python file's.

    `log_dir` receives one stderr log per command rollout.
    """
    args = section.args
    if section.command is not None:
        assert section.tasks is not None  # EnvironmentSection guarantees it
        try:
            return CommandEnvironment(
                section.command, section.tasks, cwd=section.workdir, log_dir=log_dir, **args
            )
        except TypeError as exc:
            raise ValueError(f"environment.args do not fit a command environment: {exc}") from exc
    path = section.path
    assert path is not None  # EnvironmentSection guarantees path or command
    if not path.is_file():
        raise FileNotFoundError(f"environment file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"lockgate_env_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    make = getattr(module, "make_environment", None)
    if make is None:
        raise ValueError(f"{path} defines no make_environment(model_dir, **args)")
    return make(model_dir, **args)  # type: ignore[no-any-return]


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def train(config: RunConfig) -> RunSummary:
    run_dir = (config.run_dir or Path("runs") / config.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(config.model_dump_json(indent=2))
    signal.signal(signal.SIGTERM, _raise_on_sigterm)

    model_dir = config.model.path or ensure_tiny_model()
    env = load_environment(config.environment, model_dir, run_dir / "logs" / "agents")
    trainer_config = TrainerConfig.model_validate(
        {**config.trainer.model_dump(), "model_dir": model_dir, "seed": config.seed}
    )
    admin_token = secrets.token_urlsafe(24)

    with contextlib.ExitStack() as stack:
        urls = config.replicas.urls
        if not urls:
            _say(f"starting {config.replicas.count} vLLM replica(s) (logs in {run_dir / 'logs'})")
            replicas = LocalReplicaSet(
                ReplicaLaunchConfig(
                    model_dir=model_dir,
                    count=config.replicas.count,
                    kv_cache_gib=config.replicas.kv_cache_gib,
                    max_model_len=config.replicas.max_model_len,
                    startup_timeout_s=config.replicas.startup_timeout_s,
                    log_dir=run_dir / "logs",
                )
            )
            stack.callback(replicas.stop)
            replicas.start()
            urls = replicas.urls
        gateway = GatewayProcess(
            GatewayConfig(
                model_dir=model_dir,
                replicas=urls,
                db_path=run_dir / "trajectories.sqlite",
                admin_token=admin_token,
                max_model_len=config.replicas.max_model_len,
                sampling=config.gateway.sampling,
                max_pause_wait_s=config.gateway.max_pause_wait_s,
                partial_rollout=config.sync.partial_rollout,
            ),
            run_dir,
            port=config.gateway.port,
        )
        stack.callback(gateway.stop)
        gateway.start()
        _say(
            f"gateway serving at {gateway.url}; starting {trainer_config.world_size} trainer rank(s)"
        )
        trainer = TrainerProcess(
            trainer_config, run_dir / "trainer", log_path=run_dir / "logs" / "trainer.log"
        )
        stack.callback(trainer.stop)
        trainer.start()

        async def run_loop() -> RunSummary:
            metrics = MetricsLog(run_dir / "metrics.jsonl", config.loop.steps)
            async with GatewayClient(gateway.url, admin_token) as client:
                try:
                    loop = TrainingLoop(
                        config.loop,
                        env,
                        client,
                        trainer,
                        metrics,
                        sync=config.sync,
                        seed=config.seed,
                    )
                    return await loop.run()
                finally:
                    metrics.close()

        _say(f"training for {config.loop.steps} steps (metrics in {run_dir / 'metrics.jsonl'})")
        summary = asyncio.run(run_loop())
        _say("run finished; stopping trainer, gateway and replicas")
    return summary
