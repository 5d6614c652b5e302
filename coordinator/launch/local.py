"""Bring up a whole run on this machine: replicas, gateway, trainer ranks, the loop; tear down.

The processes are started from the main thread (their death signal is tied to it) and stopped
in reverse order whatever happens: normal end, an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import inspect
import logging
import signal
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from lockgate.agent_runtime import CommandEnvironment, Environment, Task
from lockgate.agent_runtime.connections import close_shared_transport
from lockgate.coordinator.config import EnvironmentSection, RunConfig
from lockgate.coordinator.launch.cpu_priority import session_niced
from lockgate.coordinator.launch.deploy_checks import (
    DeployError,
    ExternalGateway,
    check_replicas_read,
    check_run_parts,
)
from lockgate.coordinator.launch.gateway import GatewayDied, GatewayProcess
from lockgate.coordinator.launch.parts import (
    admin_token_of,
    gateway_config_of,
    new_admin_token,
    replica_launch_config_of,
    run_dir_of,
)
from lockgate.coordinator.launch.replicas import LocalReplicaSet, vllm_is_cpu_build
from lockgate.coordinator.launch.trainer import TrainerError, TrainerProcess
from lockgate.coordinator.loop.state import LoopState, load_state, truncate_steps
from lockgate.coordinator.loop.training import RunSummary, TrainingLoop, Validation
from lockgate.coordinator.loop.validation import val_tasks_of
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.coordinator.metrics.sinks import MetricSink, check_sinks, open_sinks
from lockgate.coordinator.run_dir import VAL_GATEWAY, RunDir
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.records.metrics_file import Reward, read_metrics
from lockgate.trainer import protocol
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

if TYPE_CHECKING:  # ray is an optional extra, imported only for `launcher: ray`
    from lockgate.coordinator.launch.ray.launch import RayParts

log = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """The run stopped on a failure the operator can act on; the message is one line."""


def _trainer_stopped(
    exc: BaseException, trainer: TrainerProcess, version: int
) -> RunStopped | None:
    """The one line for a trainer failure (a weight export that hit a full disk, a dead rank)
    that the loop's task group wrapped; None for any other failure."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if not isinstance(exc, TrainerError):
        return None
    # The first line says which step, the last the cause (a traceback's exception line).
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    what = lines[0].rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")
    # Imported here: trainer.checkpoint brings in torch, which loading an environment (this
    # module) must not pay for.
    from lockgate.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(protocol.checkpoints_dir(trainer.run_dir))
    kept = f"newest checkpoint: step {latest[0]}" if latest else "no checkpoint yet"
    return RunStopped(
        f"{what}; the run stopped, the replicas still serve weights version {version} ({kept}); "
        f"continue with: lockgate train --resume {trainer.run_dir.parent} (log: {trainer.log_path})"
    )


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
    if log_dir is not None and "log_dir" in inspect.signature(make).parameters:
        # An environment with processes of its own (a tool server) keeps their logs in the run.
        args = {"log_dir": log_dir, **args}
    return make(model_dir, **args)  # type: ignore[no-any-return]


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _resume_point(
    run_dir: Path, resumed_step: int, resume: bool
) -> tuple[LoopState | None, list[float]]:
    """The loop state to continue from and the rewards of the steps kept.

    Records of steps after the trainer's checkpoint describe work that is redone: they are cut
    off, so metrics.jsonl stays one record per step, contiguous. A fresh run starts both files
    empty.
    """
    metrics_path, state_path = RunDir(run_dir).metrics, RunDir(run_dir).loop_state
    if not resume or resumed_step == 0:
        if resume:
            _say("resume: the trainer found no checkpoint; starting from step 1")
        truncate_steps(metrics_path, 0)
        truncate_steps(state_path, 0)
        return None, []
    state = load_state(state_path, resumed_step)
    truncate_steps(state_path, resumed_step)
    truncate_steps(metrics_path, resumed_step)
    rewards = [float(r[Reward.MEAN]) for r in read_metrics(metrics_path)]
    _say(
        f"resuming after step {resumed_step}: {len(state.pending)} group(s) pending at the "
        f"checkpoint are dispatched again, then tasks from serial {state.next_serial}"
    )
    return state, rewards


def _validation_gateway(training: GatewayConfig, run_dir: Path) -> GatewayProcess:
    """A second gateway on the same replicas that samples greedily, for validation rollouts."""
    greedy = training.sampling.model_copy(update={"mode": "override", "temperature": 0.0})
    config = training.model_copy(update={"db_path": RunDir(run_dir).val_store, "sampling": greedy})
    return GatewayProcess(config, run_dir, name=VAL_GATEWAY)


def _replica_urls(
    config: RunConfig,
    model_dir: Path,
    run_dir: Path,
    stack: contextlib.ExitStack,
    ray_parts: RayParts | None,
) -> list[str]:
    """The replicas the config names, or ones started now (stopped by `stack`): on Ray with
    `ray_parts`, else on this machine."""
    urls = config.replicas.urls
    logs = RunDir(run_dir).logs
    if ray_parts is not None:
        _say(f"starting {config.replicas.count} vLLM replica(s) on Ray (logs in {logs})")
        urls = ray_parts.start_replicas(replica_launch_config_of(config, model_dir, logs))
    elif not urls:
        _say(f"starting {config.replicas.count} vLLM replica(s) (logs in {logs})")
        replicas = LocalReplicaSet(replica_launch_config_of(config, model_dir, logs))
        stack.callback(replicas.stop)
        replicas.start()
        urls = replicas.urls
    else:
        _say(f"using {len(urls)} running replica(s): {', '.join(urls)}")
    return urls


def _gateway(
    config: RunConfig,
    external: ExternalGateway | None,
    model_dir: Path,
    run_dir: Path,
    stack: contextlib.ExitStack,
    ray_parts: RayParts | None,
) -> tuple[str, str, GatewayConfig, GatewayProcess | None]:
    """The gateway's URL and admin token, the config of a gateway like it (validation's
    starts from it) and its process: the one at `gateway.url` (no process), or one launched now
    on the run's replicas (`_wait_serving` waits for it)."""
    if external is not None:
        _say(
            f"using the gateway at {external.url} and its replicas: {', '.join(external.replica_urls)}"
        )
        like = gateway_config_of(
            config, model_dir, external.replica_urls, run_dir, external.admin_token
        )
        return external.url, external.admin_token, like, None
    urls = _replica_urls(config, model_dir, run_dir, stack, ray_parts)
    given = admin_token_of(config.gateway)
    admin_token = given or new_admin_token()
    gateway_config = gateway_config_of(config, model_dir, urls, run_dir, admin_token)
    gateway = GatewayProcess(
        gateway_config, run_dir, port=config.gateway.port, host=config.gateway.host
    )
    stack.callback(gateway.stop)
    gateway.launch()
    return gateway.url, admin_token, gateway_config, gateway


def _wait_serving(config: RunConfig, gateway: GatewayProcess, admin_token: str) -> None:
    gateway.wait_ready(config.gateway.startup_timeout_s)
    _say(f"gateway serving at {gateway.url} (pid {gateway.pid})")
    # A made-up token is said once, here, and written nowhere: the viewer's link carries it.
    if admin_token_of(config.gateway):
        _say(f"viewer: {gateway.url}/ui/ (admin token in ${config.gateway.admin_token_env})")
    else:
        _say(f"viewer: {gateway.url}/ui/?token={admin_token}")


def _dead_gateway(gateways: list[GatewayProcess]) -> GatewayDied | None:
    return next((d for g in gateways if (d := g.died()) is not None), None)


async def _watched(
    run: Coroutine[Any, Any, RunSummary], gateways: list[GatewayProcess]
) -> RunSummary:
    """`run`, stopped with a `GatewayDied` as soon as one of the run's gateways exits.

    Alone, the loop would only see its calls fail: agents retry, a sync's pause fails with a
    traceback, and a step can wait on rollouts that never end.
    """
    main = asyncio.ensure_future(run)
    watchers = [asyncio.ensure_future(g.watch()) for g in gateways]
    try:
        await asyncio.wait([main, *watchers], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in watchers:
            task.cancel()
        if not main.done():  # a gateway died, or Ctrl-C cancelled us: the loop stops too
            main.cancel()
        # Bounded: the loop's clean-up calls to a dead gateway must not hold the stop.
        await asyncio.wait([main, *watchers], timeout=15.0)
        if main.done() and not main.cancelled():
            main.exception()  # retrieved: a failure while stopping is not logged as lost
    dead = _dead_gateway(gateways)
    if dead is None and main.done() and not main.cancelled() and main.exception() is not None:
        # A killed gateway's sockets close a moment before its exit can be seen, so the loop's
        # failed calls may come first: wait that moment out before blaming the loop.
        deadline = time.monotonic() + 2.0
        while dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            dead = _dead_gateway(gateways)
    if dead is not None:
        raise dead  # the loop's own failure, if any, is a consequence of it
    return main.result()


async def _run_loop(
    config: RunConfig,
    env: Environment,
    trainer: TrainerProcess,
    run_dir: Path,
    sinks: list[MetricSink],
    admin_token: str,
    gateway_url: str,
    validation_at: tuple[str, list[Task]] | None,
    state: LoopState | None,
    rewards: list[float],
    gateways: list[GatewayProcess],
) -> RunSummary:
    """The training loop against the started processes (`validation_at`: the validation
    gateway's URL and the held-out tasks, when validating), stopped if one of `gateways` (those
    the run started) dies."""
    metrics = MetricsLog(RunDir(run_dir).metrics, config.loop.steps, sinks=sinks)
    async with contextlib.AsyncExitStack() as clients:
        clients.push_async_callback(close_shared_transport)
        client = await clients.enter_async_context(GatewayClient(gateway_url, admin_token))
        validation = None
        if validation_at is not None:
            val_url, val_tasks = validation_at
            val_client = await clients.enter_async_context(GatewayClient(val_url, admin_token))
            validation = Validation(val_client, val_tasks)
        try:
            loop = TrainingLoop(
                config.loop,
                env,
                client,
                trainer,
                metrics,
                algorithm=config.algorithm,
                sync=config.sync,
                seed=config.seed,
                state_path=RunDir(run_dir).loop_state,
                resume=state,
                validation=validation,
                previous_rewards=rewards,
            )
            try:
                return await _watched(loop.run(), gateways)
            except Exception as exc:
                stopped = _trainer_stopped(exc, trainer, loop.version)
                if stopped is None:
                    raise
                raise stopped from exc
        finally:
            metrics.close()


def _ray_parts(
    config: RunConfig, trainer_config: TrainerConfig, stack: contextlib.ExitStack
) -> RayParts | None:
    """With `launcher: ray`, the run's hold on the cluster: both placement groups reserved
    (a `DeployError` naming the part when they do not fit), let go of by `stack`."""
    if config.launcher != "ray":
        return None
    try:
        from lockgate.coordinator.launch.ray.launch import RayParts
    except ImportError as exc:
        raise DeployError(
            f"launcher: ray needs the ray package ({exc}): pip install 'lockgate[ray]'"
        ) from None
    parts = RayParts(config, trainer_config)
    stack.callback(parts.close)
    parts.reserve()
    # ray.init installs a SIGTERM handler of its own in the driver; ours stops the run cleanly.
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    return parts


# How far this session's group yields to the trainer's: enough for the trainer to get the core
# it needs (coordinator/launch/cpu_priority.py; docs/performance.md).
TRAINER_FIRST_NICE = 10


def _trainer_first(config: RunConfig) -> bool:
    if config.trainer_first is not None:
        return config.trainer_first
    local = config.launcher == "local" and not config.replicas.urls
    return local and vllm_is_cpu_build()


def train(config: RunConfig, *, resume: bool = False) -> RunSummary:
    """Run `config`; with `resume`, continue the run in its run dir from its newest checkpoint."""
    # Bad deploy input (model dir, ports, the replicas or gateway given by URL) fails here,
    # before anything starts.
    external = check_run_parts(config, resume=resume)
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunDir(run_dir)
    # Replicas started elsewhere must read the snapshots this machine's trainer writes.
    elsewhere = external.replica_urls if external is not None else config.replicas.urls
    if elsewhere and config.launcher != "ray":
        check_replicas_read(run.snapshots, elsewhere)
    run.config.write_text(config.model_dump_json(indent=2))
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    check_sinks(config.metrics)

    model_dir = config.model.path or ensure_tiny_model()
    env = load_environment(config.environment, model_dir, run.agent_logs)
    val_tasks = val_tasks_of(env) if config.loop.val_every else None
    trainer_config = TrainerConfig.model_validate(
        {
            **config.trainer.model_dump(),
            "entropy_coef": config.algorithm.entropy_coef,
            "model_dir": model_dir,
            "seed": config.seed,
            "resume": resume or config.trainer.resume,
        }
    )

    with contextlib.ExitStack() as stack:
        if _trainer_first(config):
            stack.enter_context(session_niced(TRAINER_FIRST_NICE))
        close_env = getattr(env, "close", None)
        if callable(close_env):  # an environment's own processes stop with the run
            stack.callback(close_env)
        ray_parts = _ray_parts(config, trainer_config, stack)
        gateway_url, admin_token, gateway_config, gateway = _gateway(
            config, external, model_dir, run_dir, stack, ray_parts
        )
        _say(f"starting {trainer_config.world_size} trainer rank(s)")
        trainer_dir, trainer_log = run.trainer, run.trainer_log
        trainer = (
            TrainerProcess(trainer_config, trainer_dir, log_path=trainer_log)
            if ray_parts is None
            else ray_parts.trainer(trainer_dir, trainer_log)
        )
        stack.callback(trainer.stop)
        trainer.launch()
        val_gateway: GatewayProcess | None = None
        if val_tasks is not None:
            val_gateway = _validation_gateway(gateway_config, run_dir)
            stack.callback(val_gateway.stop)
            val_gateway.launch()
        # The gateways and the trainer start at once: each spends seconds importing and loading,
        # which one after another would add up (docs/performance.md).
        if gateway is not None:
            _wait_serving(config, gateway, admin_token)
        trainer.wait_ready()
        state, rewards = _resume_point(run_dir, trainer.resumed_step(), trainer_config.resume)
        if val_gateway is not None:
            val_gateway.wait_ready()
        if ray_parts is not None:
            gateways = [gateway_url] + ([val_gateway.url] if val_gateway is not None else [])
            ray_parts.supervise(gateways, admin_token, trainer.snapshot_dir)
            stack.callback(ray_parts.stop_supervising)
        sinks = open_sinks(
            config.metrics,
            run_dir,
            config.name,
            config.model_dump(mode="json"),
            state.step if state is not None else 0,
        )

        _say(f"training for {config.loop.steps} steps (metrics in {run.metrics})")
        # The agents share this process's event loop with the loop itself; start-up left
        # hundreds of thousands of objects (torch, transformers) that each full collection
        # would walk with that loop stopped (as in the gateway, gateway/__main__.py).
        gc.collect()
        gc.freeze()
        validation = (
            None if val_gateway is None or val_tasks is None else (val_gateway.url, val_tasks)
        )
        summary = asyncio.run(
            _run_loop(
                config,
                env,
                trainer,
                run_dir,
                sinks,
                admin_token,
                gateway_url,
                validation,
                state,
                rewards,
                [g for g in (gateway, val_gateway) if g is not None],
            )
        )
        if external is not None:
            done = "stopping the trainer (the external gateway and its replicas go on)"
        elif config.replicas.urls:
            done = "stopping trainer and gateway (the replicas it was given go on)"
        else:
            done = "stopping trainer, gateway and replicas"
        _say(f"run finished; {done}")
    return summary
