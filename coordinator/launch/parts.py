"""The gateway's and the local replicas' configs, derived from a run config in one step.

Shared by `lockgate train` (launch.py) and the commands that run one part each
(deploy_commands.py), so a gateway started alone is configured exactly as a run's own.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from lockgate.coordinator.config import GatewaySection, RunConfig, vllm_lora_rank
from lockgate.coordinator.errors import ConfigError
from lockgate.coordinator.launch.replicas import ReplicaLaunchConfig
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.calls.chat_format import ChatFormatError, resolve_chat_format
from lockgate.gateway.config import AdapterServing, GatewayConfig
from lockgate.gateway.records.advantages import AdvantageSpec
from lockgate.trainer.config import LoraSpec

if TYPE_CHECKING:  # placement.py imports deploy_checks, which imports this module
    from lockgate.coordinator.launch.placement import Placement


def replica_dtype(asked: str, device: str) -> str:
    """`auto`: bfloat16 on cuda (what GPUs serve at full speed), float32 on cpu (bf16 matmuls
    are slower than fp32 on CPUs without native bf16 units)."""
    if asked != "auto":
        return asked
    return "bfloat16" if device == "cuda" else "float32"


def run_dir_of(config: RunConfig) -> Path:
    return (config.run_dir or Path("runs") / config.name).resolve()


def adapter_name(run_dir: Path, launch: str) -> str:
    """The name a run's adapters carry on the replicas: its run dir's name, for whoever reads
    the replicas' model list; a short hash of the dir's absolute path, so that two runs on one
    fleet never share a name even when their dirs are named alike; and `launch`, a token of
    this start of the run: a resumed run publishes versions again, at the same paths and with
    other weights than before the kill, and vLLM keys its prefix cache by adapter name and
    path, so a name reused across starts could serve KV computed with the old adapter."""
    resolved = run_dir.resolve()
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", resolved.name).strip("-._") or "run"
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    return f"{readable[:40]}-{digest}-{launch}"


def new_launch_token() -> str:
    return secrets.token_hex(3)


def admin_token_of(section: GatewaySection) -> str | None:
    """The admin token from the environment variable the config names, if set."""
    return os.environ.get(section.admin_token_env) or None


def new_admin_token() -> str:
    return secrets.token_urlsafe(24)


def chat_format_of(config: RunConfig, model_dir: Path) -> str:
    """The run's chat format (model.chat_format, `auto` detected from `model_dir`): the one
    decision every part that renders uses; one that cannot be made is a `ConfigError`."""
    try:
        chat_format = resolve_chat_format(config.model.chat_format, model_dir)
    except ChatFormatError as exc:
        raise ConfigError(f"model.chat_format: {exc}") from None
    harmony_vocabulary_for(chat_format)
    return chat_format


def harmony_vocabulary_for(chat_format: str) -> None:
    """gpt-oss renders through openai-harmony, which would download its vocabulary on first use:
    point it (in this process and those it starts) at the copy scripts/setup.sh made, and make a
    missing one a `ConfigError` that names the setup step."""
    if chat_format != "gpt-oss":
        return
    from lockgate.trainer.tiny_models.harmony_vocab import MissingVocabulary, require_o200k

    try:
        require_o200k()
    except MissingVocabulary as exc:
        raise ConfigError(f"model.chat_format {chat_format}: {exc}") from None


def gateway_config_of(
    config: RunConfig, model_dir: Path, replica_urls: list[str], run_dir: Path, admin_token: str
) -> GatewayConfig:
    """The gateway a run (or `lockgate gateway` / `serve` on the same config) starts."""
    return GatewayConfig(
        model_dir=model_dir,
        renderer=chat_format_of(config, model_dir),
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
        adapter=(
            None
            if config.model.lora is None
            else AdapterServing(name=adapter_name(run_dir, new_launch_token()))
        ),
        initial_weights=(
            None
            if config.model.lora is None
            else _zero_adapter(config.model.lora, model_dir, run_dir)
        ),
    )


def _zero_adapter(lora: LoraSpec, model_dir: Path, run_dir: Path) -> str:
    """The run's zero adapter, its version 0 on the replicas: every call of a LoRA run names an
    adapter (trainer/lora.py `write_zero_adapter` says why)."""
    import json

    from lockgate.trainer.lora import ADAPTER_CONFIG, adapter_config, write_zero_adapter

    out = RunDir(run_dir).base_adapter
    # The training and validation gateways share it: written once per spec and model, so one
    # gateway's replicas never find it half replaced by the other's start.
    written = out / ADAPTER_CONFIG
    if written.is_file() and json.loads(written.read_text()) == adapter_config(lora, model_dir):
        return str(out)
    return str(write_zero_adapter(lora, model_dir, out))


def replica_launch_config_of(
    config: RunConfig, model_dir: Path, log_dir: Path, placement: Placement
) -> ReplicaLaunchConfig:
    """The vLLM replicas a run (or `lockgate replicas` / `serve`) starts, on the device and
    GPUs of `placement` (coordinator/launch/placement.py)."""
    section = config.replicas
    device = placement.replica_device
    plan = placement.gpus if device == "cuda" else None
    return ReplicaLaunchConfig(
        device=device,
        dtype=replica_dtype(section.dtype, device),
        gpus=plan.replica_gpus if plan is not None else None,
        tensor_parallel_size=section.tensor_parallel_size,
        gpu_memory_utilization=(
            plan.gpu_memory_utilization if plan is not None else section.gpu_memory_utilization
        ),
        max_num_seqs=section.max_num_seqs,
        eager=section.enforce_eager,
        model_dir=model_dir,
        count=section.count,
        host=section.host,
        base_port=section.base_port,
        kv_cache_gib=section.kv_cache_gib,
        max_model_len=section.max_model_len,
        startup_timeout_s=section.startup_timeout_s,
        log_dir=log_dir,
        max_lora_rank=None if config.model.lora is None else vllm_lora_rank(config.model.lora.rank),
        max_loras=section.max_loras,
    )
