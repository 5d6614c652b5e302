"""Start local vLLM(-CPU) OpenAI servers as child processes and wait until they serve.

Every replica runs with `VLLM_SERVER_DEV_MODE=1`, which is what exposes the RL endpoints the
gateway needs on vLLM 0.32 (`/pause`, `/resume`, `/collective_rpc` for `reload_weights`,
`/update_weight_version`, `/weight_info`); no further server flag is needed for those on CPU.
`--enable-scale-out` adds the token-in/token-out `/inference/v1/generate` route, and
`--worker-extension-cls` the direct snapshot load (gateway/vllm_ext/snapshot_load.py).
On the CPU build of vLLM the model runs eagerly (`--enforce-eager`, see `ReplicaLaunchConfig`).
On CUDA (`device`) the GPU options and CUDA_VISIBLE_DEVICES take the place of vLLM-CPU's
variables; the CPU command line and environment do not change with them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lockgate.coordinator.config import VLLM_LORA_RANKS
from lockgate.coordinator.cpu_plan import plan_cpus, usable_cpus
from lockgate.coordinator.errors import RunFailed
from lockgate.coordinator.launch.processes import client_host, free_port, log_tail, spawn, terminate
from lockgate.gateway.sync.weights import SNAPSHOT_LOAD_EXTENSION
from lockgate.gateway.vllm_ext.routes import REPLICA_ROUTES

_POLL_S = 0.5
# No allocation straight from mmap (large ones would go back to the system when freed), and
# no trimming of the heap's free top (up to 64 GiB).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
_STOP_GRACE_S = 15.0
_GROUP_EXIT_S = 5.0
# vLLM refuses runtime adapter loads and unloads without it.
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


class ReplicaStartError(RunFailed):
    """A replica did not serve; the message says why and carries its log's tail."""


class ReplicaLaunchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: Path
    count: int = Field(default=1, ge=1)
    host: str = "127.0.0.1"
    # None: a free port per replica; otherwise replica i listens on base_port + i.
    base_port: int | None = Field(default=None, ge=1, le=65535)
    kv_cache_gib: int = Field(default=1, ge=1)
    max_model_len: int = Field(default=1024, ge=1)
    dtype: str = "float32"
    # cpu: vLLM-CPU's variables (KV cache size, OpenMP thread binding); cuda: the GPU options
    # below and CUDA_VISIBLE_DEVICES, none of the CPU-only variables.
    device: Literal["cpu", "cuda"] = "cpu"
    # cuda: each replica's CUDA_VISIBLE_DEVICES (coordinator/launch/placement.py); None: the
    # ones the process inherits (Ray sets them for a replica's actor).
    gpus: list[list[str]] | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    # None: vLLM's own default.
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    # None: replica i's threads are bound where the CPU plan puts them (coordinator/cpu_plan.py).
    cpu_binds: list[str] | None = None
    startup_timeout_s: float = Field(default=300.0, gt=0)
    log_dir: Path
    extra_args: list[str] = Field(default_factory=list)
    # The worker extension that loads disk snapshots directly (gateway/vllm_ext/snapshot_load.py);
    # without it the gateway loads them with vLLM's reload_weights.
    snapshot_load: bool = True
    # lockgate's pause route (gateway/vllm_ext/routes.py): vLLM's engine pause without the 20 ms
    # sleep vLLM's own /pause adds; without it the gateway uses /pause.
    pause_route: bool = True
    # None: eager on the CPU build of vLLM only. vLLM-CPU 0.32 traces the model with
    # torch.compile but without inductor, and fails to load its own compile cache ("'function'
    # object has no attribute 'finalize_loading'"), so each start traced again: eager replicas
    # start far sooner and generate as fast (docs/performance.md, "Coordinator:
    # launching on a CPU machine"). On GPUs compilation and CUDA graphs pay.
    eager: bool | None = None
    # glibc keeps memory freed by the process for reuse instead of returning it to the
    # system: a weight load replaces ~all of the model's packed weights, and memory taken
    # fresh from the system costs a page fault per 4 KiB, most of a load's time here (what
    # vLLM's advice to preload tcmalloc on CPU is about). The replica's footprint stays at
    # its peak instead of shrinking between loads.
    keep_freed_memory: bool = True
    # Serve the base model with LoRA on, adapters up to this rank loaded at runtime (one of
    # VLLM_LORA_RANKS); None: no LoRA.
    max_lora_rank: int | None = None
    max_loras: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _enough_binds(self) -> Self:
        if self.cpu_binds is not None and len(self.cpu_binds) < self.count:
            raise ValueError(
                f"cpu_binds has {len(self.cpu_binds)} entries for {self.count} replicas"
            )
        if self.base_port is not None and self.base_port + self.count - 1 > 65535:
            raise ValueError("base_port + count - 1 exceeds 65535")
        if self.gpus is not None and len(self.gpus) < self.count:
            raise ValueError(f"gpus has {len(self.gpus)} entries for {self.count} replicas")
        if self.max_lora_rank is not None and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VLLM_LORA_RANKS}")
        return self


@dataclass
class Replica:
    index: int
    url: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]


def vllm_is_cpu_build() -> bool:
    """The vLLM installed here is the CPU build (its distribution is named vllm-cpu)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def replica_command(c: ReplicaLaunchConfig, host: str, port: int) -> list[str]:
    """The vLLM server command of one replica listening on `host:port` (here or on a Ray node,
    which has the same vLLM build as this one)."""
    eager = vllm_is_cpu_build() if c.eager is None else c.eager
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(c.model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        c.dtype,
        "--max-model-len",
        str(c.max_model_len),
        "--enable-scale-out",
        *(["--worker-extension-cls", SNAPSHOT_LOAD_EXTENSION] if c.snapshot_load else []),
        *(["--middleware", REPLICA_ROUTES] if c.pause_route else []),
        *(["--enforce-eager"] if eager else []),
        *(_cuda_args(c) if c.device == "cuda" else []),
        *(["--max-num-seqs", str(c.max_num_seqs)] if c.max_num_seqs is not None else []),
        *_lora_args(c),
        *c.extra_args,
    ]


def _lora_args(c: ReplicaLaunchConfig) -> list[str]:
    if c.max_lora_rank is None:
        return []
    rank, slots = str(c.max_lora_rank), str(c.max_loras)
    return ["--enable-lora", "--max-lora-rank", rank, "--max-loras", slots]


def _cuda_args(c: ReplicaLaunchConfig) -> list[str]:
    util = c.gpu_memory_utilization
    return [
        "--tensor-parallel-size",
        str(c.tensor_parallel_size),
        *(["--gpu-memory-utilization", f"{util:g}"] if util is not None else []),
    ]


def xgrammar_cache_environment() -> dict[str, str]:
    """`VLLM_XGRAMMAR_CACHE_MB=0` where the installed xgrammar is 0.2.8 or older: its compiler
    cache shares one token mask between grammar rules that differ only in a token, so a forced
    tool call whose head is held to the tokenizer's tokens (gateway/calls/forced_budget.py)
    would be masked by another call's tokens and fail in the replica. 0.2.9 keys them apart."""
    try:
        version = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return {}
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:3])
    return {"VLLM_XGRAMMAR_CACHE_MB": "0"} if parts < (0, 2, 9) else {}


def replica_environment(
    c: ReplicaLaunchConfig, cpu_bind: str, gpus: list[str] | None = None
) -> dict[str, str]:
    """The environment of one replica's server: on cpu its OpenMP threads bound to
    `cpu_bind`; on cuda its GPUs in CUDA_VISIBLE_DEVICES (`gpus`; None: those inherited)."""
    lora = RUNTIME_LORA_ENV if c.max_lora_rank is not None else {}
    if c.device == "cuda":
        return {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            **({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else {}),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **xgrammar_cache_environment(),
            **lora,
        }
    return {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        # Without an explicit size vLLM-CPU wants most of the NUMA node's memory free, so a
        # second replica on the same machine would fail to start.
        "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(KEEP_FREED_MEMORY if c.keep_freed_memory else {}),
        **xgrammar_cache_environment(),
        **lora,
    }


def wait_serving(replicas: list[Replica], timeout_s: float) -> None:
    """Return once every replica answers /health; `ReplicaStartError` (with its log's tail)
    when one exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for replica in list(pending):
                code = replica.proc.poll()
                if code is not None:
                    raise ReplicaStartError(
                        f"replica {replica.index} ({replica.url}) exited with code {code} "
                        f"before serving; log {replica.log_path}:\n{log_tail(replica.log_path)}"
                    )
                try:
                    if client.get(f"{replica.url}/health").status_code == 200:
                        pending.remove(replica)
                except httpx.TransportError:
                    pass
            if not pending:
                return
            if time.monotonic() >= deadline:
                replica = pending[0]
                raise ReplicaStartError(
                    f"replica {replica.index} ({replica.url}) did not serve within "
                    f"{timeout_s:.0f}s; log {replica.log_path}:\n{log_tail(replica.log_path)}"
                )
            time.sleep(_POLL_S)


def await_group_exit(pgid: int, timeout_s: float = _GROUP_EXIT_S) -> None:
    # vLLM's engine core and worker outlive the server process by a moment and, orphaned, wait
    # to be reaped by init; until then the group still exists. Waiting here lets callers rely
    # on "stop() returned, so nothing of the replica is left". Bounded, as an init that never
    # reaps would otherwise hang the caller on harmless zombies.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)


class LocalReplicaSet:
    """`count` vLLM servers on this machine; a context manager that starts and stops them."""

    def __init__(self, config: ReplicaLaunchConfig) -> None:
        self.config = config
        self._replicas: list[Replica] = []
        self._stopped: set[int] = set()

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self._replicas]

    def command(self, port: int) -> list[str]:
        return replica_command(self.config, self.config.host, port)

    def environment(self, cpu_bind: str, gpus: list[str] | None = None) -> dict[str, str]:
        return replica_environment(self.config, cpu_bind, gpus)

    def _ports(self) -> list[int]:
        c = self.config
        if c.base_port is not None:
            return [c.base_port + i for i in range(c.count)]
        ports: list[int] = []
        while len(ports) < c.count:
            # free_port() releases the port before returning it, so it can hand out the same
            # one twice in a row.
            port = free_port(c.host if c.host not in ("", "0.0.0.0", "::") else "127.0.0.1")
            if port not in ports:
                ports.append(port)
        return ports

    def start(self) -> None:
        if self._replicas:
            raise RuntimeError("this replica set has already been started")
        c = self.config
        binds = c.cpu_binds or list(plan_cpus(usable_cpus(), replicas=c.count).replica_binds)
        # All spawned before any is waited on: model loading dominates and runs in parallel.
        try:
            for i, port in enumerate(self._ports()):
                log_path = c.log_dir / f"replica{i}.log"
                gpus = c.gpus[i] if c.gpus is not None else None
                env = self.environment(binds[i], gpus)
                proc = spawn(self.command(port), log_path, env=env, guard=True)
                url = f"http://{client_host(c.host)}:{port}"
                self._replicas.append(Replica(i, url, port, log_path, proc))
        except BaseException:
            self.stop()
            raise
        try:
            self._wait_healthy()
        except BaseException:
            # Also on KeyboardInterrupt: the servers must not outlive a failed start.
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        wait_serving(self._replicas, self.config.startup_timeout_s)

    def stop(self) -> None:
        """Stop every replica and whatever it started; safe to call more than once."""
        live = [r for r in self._replicas if r.index not in self._stopped]
        # SIGTERM to all first so the servers shut down side by side, not one grace at a time.
        for replica in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.proc.pid, signal.SIGTERM)
        for replica in live:
            terminate(replica.proc, grace_s=_STOP_GRACE_S)
        for replica in live:
            await_group_exit(replica.proc.pid)
            self._stopped.add(replica.index)

    def kill(self, index: int) -> None:
        """SIGKILL one replica's whole process group, as a crash would (for failover tests)."""
        replica = self._replicas[index]
        if index in self._stopped:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(replica.proc.pid, signal.SIGKILL)
        replica.proc.wait(timeout=10.0)
        await_group_exit(replica.proc.pid)
        self._stopped.add(index)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
