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
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from lockgate.agent_runtime import CommandEnvironment, Environment, Task
from lockgate.agent_runtime.connections import close_shared_transport
from lockgate.agent_runtime.service import ServiceEnvironment, ServiceOptions
from lockgate.coordinator.config import EnvironmentSection, RunConfig
from lockgate.coordinator.cpu_plan import CpuPlan, plan_here
from lockgate.coordinator.errors import LockgateError, RunFailed
from lockgate.coordinator.launch.advertise import advertised_url
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
    chat_format_of,
    gateway_config_of,
    new_admin_token,
    replica_launch_config_of,
    run_dir_of,
)
from lockgate.coordinator.launch.placement import (
    Placement,
    placement_here,
    placement_lines,
    trainer_gpus,
)
from lockgate.coordinator.launch.processes import free_port
from lockgate.coordinator.launch.replicas import LocalReplicaSet, vllm_is_cpu_build
from lockgate.coordinator.launch.trainer import TrainerError, TrainerProcess
from lockgate.coordinator.loop.client_rollouts import enrol_clients
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
    from lockgate.coordinator.launch.ray.trainer import RayTrainerRanks

log = logging.getLogger(__name__)


class RunStopped(RunFailed):
    """The run stopped on a failure the operator can act on; the message is one line."""


def _loop_failure(exc: Exception, trainer: TrainerProcess, version: int) -> LockgateError | None:
    """The error to report for a failure of the loop that its task group wrapped: a trainer
    failure as one `RunStopped` line, any other of ours as it is; None for the rest."""
    inner: BaseException = exc
    while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
        inner = inner.exceptions[0]
    if isinstance(inner, TrainerError):
        return _trainer_stopped(inner, trainer, version)
    return inner if isinstance(inner, LockgateError) and inner is not exc else None


def _trainer_stopped(exc: TrainerError, trainer: TrainerProcess, version: int) -> RunStopped:
    """The one line for a trainer failure (a weight export that hit a full disk, a dead rank)."""
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
    """The run's environment: a CommandEnvironment for `command`, a ServiceEnvironment for
    `url`, else the Python file's.

    `log_dir` receives one stderr log per command rollout.
    """
    args = section.args
    if section.url is not None:
        assert section.tasks is not None  # EnvironmentSection guarantees it
        try:
            options = ServiceOptions.model_validate(args)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise ValueError(f"environment.args do not fit a service environment: {exc}") from exc
        return ServiceEnvironment(str(section.url), section.tasks, options)
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


def _validation_gateway(training: GatewayConfig, run_dir: Path, host: str) -> GatewayProcess:
    """A second gateway on the same replicas that samples greedily, for validation rollouts;
    it listens where the training one does, so that agents elsewhere reach it too."""
    greedy = training.sampling.model_copy(update={"mode": "override", "temperature": 0.0})
    update: dict[str, object] = {"db_path": RunDir(run_dir).val_store, "sampling": greedy}
    if training.adapter is not None:
        # Adapters of its own: each gateway loads and unloads the adapters it names.
        update["adapter"] = training.adapter.model_copy(
            update={"name": f"{training.adapter.name}-val"}
        )
    return GatewayProcess(training.model_copy(update=update), run_dir, name=VAL_GATEWAY, host=host)


def _replica_urls(
    config: RunConfig,
    model_dir: Path,
    run_dir: Path,
    stack: contextlib.ExitStack,
    ray_parts: RayParts | None,
    placement: Placement,
) -> list[str]:
    """The replicas the config names, or ones started now (stopped by `stack`): on Ray with
    `ray_parts`, else on this machine, on the devices of `placement`."""
    urls = config.replicas.urls
    logs = RunDir(run_dir).logs
    if ray_parts is not None:
        _say(f"starting {config.replicas.count} vLLM replica(s) on Ray (logs in {logs})")
        launch = replica_launch_config_of(config, model_dir, logs, placement)
        urls = ray_parts.start_replicas(launch)
    elif not urls:
        _say(f"starting {config.replicas.count} vLLM replica(s) (logs in {logs})")
        if placement.replica_device == "cpu":
            _say(_cpu_plan(config).line())
        replicas = LocalReplicaSet(replica_launch_config_of(config, model_dir, logs, placement))
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
    placement: Placement,
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
    urls = _replica_urls(config, model_dir, run_dir, stack, ray_parts, placement)
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


@dataclass
class _Parts:
    """A run's processes once launched: the gateway the loop calls (no process when it runs
    elsewhere), the validation gateway when the run validates, and the trainer."""

    gateway_url: str
    admin_token: str
    gateway: GatewayProcess | None
    val_gateway: GatewayProcess | None
    trainer: TrainerProcess

    def started_gateways(self) -> list[GatewayProcess]:
        """The gateways this run started: the run stops if one of them dies."""
        return [g for g in (self.gateway, self.val_gateway) if g is not None]

    def public_urls(self, config: RunConfig) -> dict[str, str]:
        """Each gateway's URL as the coordinator reaches it -> as agents elsewhere do
        (advertise.py); `gateway.advertise_url` names the training gateway only."""
        section = config.gateway
        listen = section.host if self.gateway is not None else None
        urls = {self.gateway_url: advertised_url(self.gateway_url, listen, section.advertise_url)}
        if self.val_gateway is not None:
            urls[self.val_gateway.url] = advertised_url(self.val_gateway.url, section.host)
        return urls


async def _run_loop(
    config: RunConfig,
    env: Environment,
    parts: _Parts,
    run_dir: Path,
    sinks: list[MetricSink],
    validation_at: tuple[str, list[Task]] | None,
    state: LoopState | None,
    rewards: list[float],
) -> RunSummary:
    """The training loop against the started processes (`validation_at`: the validation
    gateway's URL and the held-out tasks, when validating), stopped if a gateway the run
    started dies."""
    trainer, admin_token = parts.trainer, parts.admin_token
    metrics = MetricsLog(RunDir(run_dir).metrics, config.loop.steps, sinks=sinks)
    async with contextlib.AsyncExitStack() as clients:
        clients.push_async_callback(close_shared_transport)
        client = await clients.enter_async_context(GatewayClient(parts.gateway_url, admin_token))
        public_urls = parts.public_urls(config)
        if isinstance(env, ServiceEnvironment):  # it checks a session's records before a retry
            env.attach_gateway(admin_token, public_roots=public_urls)
        validation = None
        if validation_at is not None:
            val_url, val_tasks = validation_at
            val_client = await clients.enter_async_context(GatewayClient(val_url, admin_token))
            validation = Validation(val_client, val_tasks)
        source = None
        if config.loop.rollouts == "client":
            source, enrolment = enrol_clients(
                client,
                run_dir,
                config.loop.group_size,
                config.loop.rollout_timeout_s,
                url=public_urls[parts.gateway_url],
                resume=state is not None,
            )
            _say(
                f"client-driven rollouts: enrol sessions at {enrolment.url}/v1/sessions with "
                f"the key {enrolment.key} (also in {RunDir(run_dir).enrolment}), groups of "
                f"{enrolment.group_size}"
            )
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
                source=source,
                adapters=config.model.lora is not None,
            )
            try:
                return await _watched(loop.run(), parts.started_gateways())
            except Exception as exc:
                failure = _loop_failure(exc, trainer, loop.version)
                if failure is None:
                    raise
                # Ours is reported as it is, not as the task group around it.
                raise failure from (exc if isinstance(failure, RunStopped) else None)
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


def _placement(
    config: RunConfig,
    external: ExternalGateway | None,
    model_dir: Path,
    trainer_config: TrainerConfig,
    ray_parts: RayParts | None,
) -> Placement:
    """The devices of the run's parts and, on this node's GPUs, each part's GPUs (printed):
    the cluster's on Ray, where Ray assigns the GPUs."""
    if ray_parts is not None:
        return ray_parts.placement
    here = 0 if external is not None or config.replicas.urls else config.replicas.count
    placement = placement_here(
        config, model_dir, replicas_here=here, trainer_ranks=trainer_config.world_size
    )
    for line in placement_lines(placement):
        _say(line)
    return placement


# How far this session's group yields to the trainer's: enough for the trainer to get the core
# it needs (coordinator/launch/cpu_priority.py; docs/performance.md).
TRAINER_FIRST_NICE = 10


def _cpu_plan(config: RunConfig) -> CpuPlan:
    """How the local replicas and trainer ranks share this machine's cores."""
    return plan_here(
        replicas=config.replicas.count,
        trainer_ranks=config.trainer.world_size,
        threads_per_rank=config.trainer.num_threads,
    )


def _trainer_first(config: RunConfig) -> bool:
    if config.trainer_first is not None:
        return config.trainer_first
    local = config.launcher == "local" and not config.replicas.urls
    return local and vllm_is_cpu_build()


def _check_and_record(config: RunConfig, resume: bool) -> ExternalGateway | None:
    """Check the run's deploy input, then write its config into its run dir; the gateway at
    `gateway.url` when the run uses one. Bad deploy input (model dir, ports, the replicas or
    gateway given by URL) fails here, before anything starts."""
    external = check_run_parts(config, resume=resume)
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunDir(run_dir)
    # Replicas started elsewhere must read the snapshots this machine's trainer writes.
    elsewhere = external.replica_urls if external is not None else config.replicas.urls
    if elsewhere and config.launcher != "ray" and config.sync.transport == "disk":
        check_replicas_read(run.snapshots, elsewhere)
    run.config.write_text(config.model_dump_json(indent=2))
    return external


def _trainer_config(config: RunConfig, model_dir: Path, resume: bool) -> TrainerConfig:
    """The trainer ranks' config: the run's trainer section and what it takes from the rest."""
    return TrainerConfig.model_validate(
        {
            **config.trainer.model_dump(exclude={"gpus"}),
            "entropy_coef": config.algorithm.entropy_coef,
            "model_dir": model_dir,
            "seed": config.seed,
            "resume": resume or config.trainer.resume,
            "weights": config.sync.transport,
            "lora": config.model.lora,
        }
    )


def _with_weights_group(
    config: RunConfig, placement: Placement, ray_trainer: RayTrainerRanks | None = None
) -> RunConfig:
    """With `sync.transport: collective`, the group's backend (nccl only where replicas and
    trainer both run on cuda: every member must speak it) and where it meets, decided once,
    before the loop uses them. Locally that is this machine, where the trainer runs, at a free
    port unless given; under Ray it is rank 0's node, known only once Ray has placed the
    ranks: `ray_trainer` is then given, after their launch."""
    if config.sync.transport != "collective":
        return config
    group = config.sync.collective
    backend = group.backend
    if backend == "auto":
        cuda = placement.replica_device == placement.trainer_device == "cuda"
        backend = "nccl" if cuda else "gloo"
    update: dict[str, Any] = {"backend": backend}
    if ray_trainer is not None:
        update["address"], update["port"] = ray_trainer.weights_group_endpoint(group.port)
    elif config.launcher == "local":
        update["port"] = group.port or free_port()
    group = group.model_copy(update=update)
    if "port" in update:
        _say(f"weights: collective, {backend} group at {group.address}:{group.port}")
    sync = config.sync.model_copy(update={"collective": group})
    return config.model_copy(update={"sync": sync})


def _launch_parts(
    config: RunConfig,
    external: ExternalGateway | None,
    model_dir: Path,
    run_dir: Path,
    trainer_config: TrainerConfig,
    *,
    validate: bool,
    stack: contextlib.ExitStack,
    ray_parts: RayParts | None,
    placement: Placement,
) -> _Parts:
    """Launch the gateway (on replicas started first when the run starts its own), the trainer
    and, with `validate`, the validation gateway, without waiting for them; `stack` stops them."""
    gateway_url, admin_token, gateway_config, gateway = _gateway(
        config, external, model_dir, run_dir, stack, ray_parts, placement
    )
    _say(f"starting {trainer_config.world_size} trainer rank(s)")
    run = RunDir(run_dir)
    trainer = (
        TrainerProcess(
            trainer_config, run.trainer, log_path=run.trainer_log, gpus=trainer_gpus(placement)
        )
        if ray_parts is None
        else ray_parts.trainer(run.trainer, run.trainer_log)
    )
    stack.callback(trainer.stop)
    trainer.launch()
    val_gateway: GatewayProcess | None = None
    if validate:
        val_gateway = _validation_gateway(gateway_config, run_dir, config.gateway.host)
        stack.callback(val_gateway.stop)
        val_gateway.launch()
    return _Parts(gateway_url, admin_token, gateway, val_gateway, trainer)


def _wait_parts(
    config: RunConfig,
    parts: _Parts,
    run_dir: Path,
    trainer_config: TrainerConfig,
    stack: contextlib.ExitStack,
    ray_parts: RayParts | None,
) -> tuple[LoopState | None, list[float]]:
    """Wait until the launched parts serve, and return where the loop resumes (`_resume_point`).
    On Ray, the cluster's supervision starts then, stopped by `stack`."""
    # The gateways and the trainer start at once: each spends seconds importing and loading,
    # which one after another would add up (docs/performance.md).
    if parts.gateway is not None:
        _wait_serving(config, parts.gateway, parts.admin_token)
    parts.trainer.wait_ready()
    state, rewards = _resume_point(run_dir, parts.trainer.resumed_step(), trainer_config.resume)
    if parts.val_gateway is not None:
        # Started beside the main gateway, it loads the same model under the same load.
        parts.val_gateway.wait_ready(config.gateway.startup_timeout_s)
    if ray_parts is not None:
        val_urls = [parts.val_gateway.url] if parts.val_gateway is not None else []
        # The collective transport writes no snapshot a replacement could load.
        snapshots = None if config.sync.transport == "collective" else parts.trainer.snapshot_dir
        ray_parts.supervise([parts.gateway_url, *val_urls], parts.admin_token, snapshots)
        stack.callback(ray_parts.stop_supervising)
    return state, rewards


def _stopping_what(config: RunConfig, external: ExternalGateway | None) -> str:
    """What the end of the run stops: only the parts the run started itself."""
    if external is not None:
        return "stopping the trainer (the external gateway and its replicas go on)"
    if config.replicas.urls:
        return "stopping trainer and gateway (the replicas it was given go on)"
    return "stopping trainer, gateway and replicas"


def train(config: RunConfig, *, resume: bool = False) -> RunSummary:
    """Run `config`; with `resume`, continue the run in its run dir from its newest checkpoint."""
    external = _check_and_record(config, resume)
    run_dir = run_dir_of(config)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    check_sinks(config.metrics)

    model_dir = config.model.path or ensure_tiny_model()
    _say(f"chat format: {chat_format_of(config, model_dir)}")  # before anything starts
    env = load_environment(config.environment, model_dir, RunDir(run_dir).agent_logs)
    val_tasks = val_tasks_of(env) if config.loop.val_every else None
    trainer_config = _trainer_config(config, model_dir, resume)

    with contextlib.ExitStack() as stack:
        if _trainer_first(config):
            stack.enter_context(session_niced(TRAINER_FIRST_NICE))
        close_env = getattr(env, "close", None)
        if callable(close_env):  # an environment's own processes stop with the run
            stack.callback(close_env)
        ray_parts = _ray_parts(config, trainer_config, stack)
        placement = _placement(config, external, model_dir, trainer_config, ray_parts)
        config = _with_weights_group(config, placement)
        parts = _launch_parts(
            config,
            external,
            model_dir,
            run_dir,
            trainer_config,
            validate=val_tasks is not None,
            stack=stack,
            ray_parts=ray_parts,
            placement=placement,
        )
        if ray_parts is not None:
            config = _with_weights_group(config, placement, ray_parts.ranks)
        state, rewards = _wait_parts(config, parts, run_dir, trainer_config, stack, ray_parts)
        sinks = open_sinks(
            config.metrics,
            run_dir,
            config.name,
            config.model_dump(mode="json"),
            state.step if state is not None else 0,
        )

        _say(f"training for {config.loop.steps} steps (metrics in {RunDir(run_dir).metrics})")
        # The agents share this process's event loop with the loop itself; start-up left
        # hundreds of thousands of objects (torch, transformers) that each full collection
        # would walk with that loop stopped (as in the gateway, gateway/__main__.py).
        gc.collect()
        gc.freeze()
        val_gateway = parts.val_gateway
        validation = (
            None if val_gateway is None or val_tasks is None else (val_gateway.url, val_tasks)
        )
        try:
            summary = asyncio.run(
                _run_loop(config, env, parts, run_dir, sinks, validation, state, rewards)
            )
        finally:
            # Frozen objects are never collected, not even at exit: triton's bindings (which
            # transformers' imports load) then report hundreds of leaks as the last screen.
            gc.unfreeze()
        _say(f"run finished; {_stopping_what(config, external)}")
    return summary
