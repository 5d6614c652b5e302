"""The gateway's and the local replicas' configs, derived from a run config in one step.

Shared by `lockgate train` (launch.py) and the commands that run one part each
(deploy_commands.py), so a gateway started alone is configured exactly as a run's own.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from lockgate.coordinator.config import GatewaySection, RunConfig
from lockgate.coordinator.launch.replicas import ReplicaLaunchConfig
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.records.advantages import AdvantageSpec


def run_dir_of(config: RunConfig) -> Path:
    return (config.run_dir or Path("runs") / config.name).resolve()


def admin_token_of(section: GatewaySection) -> str | None:
    """The admin token from the environment variable the config names, if set."""
    return os.environ.get(section.admin_token_env) or None


def new_admin_token() -> str:
    return secrets.token_urlsafe(24)


def gateway_config_of(
    config: RunConfig, model_dir: Path, replica_urls: list[str], run_dir: Path, admin_token: str
) -> GatewayConfig:
    """The gateway a run (or `lockgate gateway` / `serve` on the same config) starts."""
    return GatewayConfig(
        model_dir=model_dir,
        replicas=replica_urls,
        db_path=RunDir(run_dir).store,
        metrics_path=RunDir(run_dir).metrics,
        admin_token=admin_token,
        max_model_len=config.replicas.max_model_len,
        sampling=config.gateway.sampling,
        max_pause_wait_s=config.gateway.max_pause_wait_s,
        limits=config.gateway.limits,
        partial_rollout=config.sync.partial_rollout,
        advantages=AdvantageSpec.model_validate(
            config.algorithm.model_dump(include=set(AdvantageSpec.model_fields))
        ),
    )


def replica_launch_config_of(
    config: RunConfig, model_dir: Path, log_dir: Path
) -> ReplicaLaunchConfig:
    """The local vLLM replicas a run (or `lockgate replicas` / `serve`) starts."""
    section = config.replicas
    return ReplicaLaunchConfig(
        model_dir=model_dir,
        count=section.count,
        host=section.host,
        base_port=section.base_port,
        kv_cache_gib=section.kv_cache_gib,
        max_model_len=section.max_model_len,
        startup_timeout_s=section.startup_timeout_s,
        log_dir=log_dir,
    )
