"""The commands that run one part of lockgate each, as a service in the foreground:
`lockgate replicas`, `lockgate gateway` and `lockgate serve` (both, for agents without training);
`lockgate session new` (cli/session.py) makes sessions on what they serve.

Each takes the run config's own sections (model, replicas, gateway; a run config file works
as it is), layered: defaults < the file < `LOCKGATE_<SECTION>__<FIELD>` variables < `--set`.
Bad input is a `DeployError` (one line, exit 2) before anything starts (launch/deploy_checks.py).
What a service prints on stdout is `name=value` lines (`replica_url=`, `gateway_url=`), once it
serves; its progress goes to stderr. Ctrl-C or SIGTERM stops it and everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from lockgate.coordinator.cli.options import Subcommands, add_overrides, load_run_config
from lockgate.coordinator.config import (
    GatewaySection,
    ModelSection,
    ReplicasSection,
    RunConfig,
    describe_options,
)
from lockgate.coordinator.errors import RunFailed
from lockgate.coordinator.launch.deploy_checks import (
    DeployError,
    check_model_dir,
    check_port_free,
    check_replica_ports,
    check_replicas,
)
from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.coordinator.launch.parts import (
    admin_token_of,
    gateway_config_of,
    new_admin_token,
    replica_launch_config_of,
    run_dir_of,
)
from lockgate.coordinator.launch.placement import Placement, placement_here, placement_lines
from lockgate.coordinator.launch.processes import client_host, free_port
from lockgate.coordinator.launch.replicas import LocalReplicaSet
from lockgate.coordinator.run_dir import RunDir

_SECTIONS_HELP = (
    "config options (the run config's sections; a file, LOCKGATE_<SECTION>__<FIELD> variables "
    "such as LOCKGATE_GATEWAY__PORT=8000, then --set):\n"
    + "\n".join(
        [
            *describe_options(ModelSection, "model."),
            *describe_options(ReplicasSection, "replicas."),
            *describe_options(GatewaySection, "gateway."),
        ]
    )
)


def _say(message: str) -> None:
    print(f"[lockgate] {message}", file=sys.stderr, flush=True)


def _emit(name: str, value: str) -> None:
    print(f"{name}={value}", flush=True)


def add_parser(sub: Subcommands) -> None:
    """`replicas`, `gateway` and `serve` under the `lockgate` parser."""
    commands = {
        "replicas": (
            "start replicas.count local vLLM replicas; print their URLs; serve until stopped",
            "Start replicas.count vLLM(-CPU) servers of model.path with lockgate's worker "
            "extension and pause route (weights can be synced into them), print "
            "`replica_url=URL` per replica once all serve, and keep them until Ctrl-C or "
            "SIGTERM. Logs: RUN_DIR/logs/replicaN.log.",
        ),
        "gateway": (
            "run the gateway alone, in front of replicas.urls, until stopped",
            "Serve the OpenAI-compatible gateway on gateway.host:gateway.port in front of the "
            "replicas at replicas.urls (none: add them with POST /admin/replicas), recording "
            "trajectories in RUN_DIR/trajectories.sqlite. The admin token is read from "
            "$LOCKGATE_ADMIN_TOKEN (gateway.admin_token_env); unset, a random one is made and "
            "printed as `admin_token=...`. Prints `gateway_url=URL` once it serves.",
        ),
        "serve": (
            "replicas + gateway for agents without training (collect trajectories, evaluate)",
            "Start replicas.count local replicas (or use replicas.urls) and a gateway in front "
            "of them; print `replica_url=`, `gateway_url=` (and `admin_token=` when made up "
            "here); serve until Ctrl-C or SIGTERM. Create sessions with `lockgate session new` "
            "or POST /admin/sessions (docs/deploy.md).",
        ),
    }
    for name, (short, description) in commands.items():
        parser = sub.add_parser(
            name,
            help=short,
            description=textwrap.fill(description, 88),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=_SECTIONS_HELP,
        )
        parser.add_argument(
            "config",
            type=Path,
            nargs="?",
            help="config file (.yaml/.toml; a run config works: its other sections are unused)",
        )
        add_overrides(parser, "gateway.port=8000")
        parser.add_argument(
            "--run-dir", type=Path, help="logs and trajectories (default runs/NAME)"
        )
        parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.set)
    if args.run_dir is not None:
        config.run_dir = args.run_dir
    command = {"replicas": _replicas, "gateway": _gateway, "serve": _serve}[args.command]
    return command(config)


# -- services ------------------------------------------------------------------------------------


def _model_dir(config: RunConfig) -> Path:
    if config.model.path is not None:
        return config.model.path
    from lockgate.trainer.tiny_models.builder import ensure_tiny_model  # torch: only when needed

    return ensure_tiny_model()


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


def _children_of(replicas: LocalReplicaSet) -> list[_Child]:
    return [_Child(f"replica {r.index} ({r.url})", r.proc, r.log_path) for r in replicas.replicas]


def _serve_until_stopped(children: list[_Child]) -> int:
    """Wait for Ctrl-C or SIGTERM (0), or for a child to exit (a `RunFailed` naming it)."""
    try:
        while True:
            for child in children:
                code = child.proc.poll()
                if code is not None:
                    raise RunFailed(
                        f"{child.name} exited with code {code}; log {child.log_path}; "
                        "stopping the rest"
                    )
            time.sleep(0.5)
    except KeyboardInterrupt:
        _say("stopping")
        return 0


@contextlib.contextmanager
def _service() -> Iterator[contextlib.ExitStack]:
    """An exit stack whose callbacks stop what was started, on any exit; SIGTERM is Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        with contextlib.ExitStack() as stack:
            yield stack
    finally:
        signal.signal(signal.SIGTERM, previous)


def _admin_token(section: GatewaySection) -> tuple[str, bool]:
    """The admin token from the environment, or a fresh one (then True: print it)."""
    token = admin_token_of(section)
    if token is None:
        return new_admin_token(), True
    if len(token) < 8:
        raise DeployError(f"${section.admin_token_env}: the admin token needs 8 characters or more")
    return token, False


def _placed(config: RunConfig, model_dir: Path) -> Placement:
    """The replicas' device and GPUs on this node (printed when any is a GPU)."""
    placement = placement_here(
        config, model_dir, replicas_here=config.replicas.count, trainer_ranks=0
    )
    for line in placement_lines(placement):
        _say(line)
    return placement


def _replicas(config: RunConfig) -> int:
    if config.replicas.urls:
        raise DeployError(
            "replicas.urls names replicas running elsewhere; `lockgate replicas` starts "
            "replicas.count of its own (leave replicas.urls empty)"
        )
    check_model_dir(config.model.path)
    check_replica_ports(config.replicas)
    run_dir = run_dir_of(config)
    model_dir = _model_dir(config)
    _say(
        f"starting {config.replicas.count} vLLM replica(s) of {model_dir} "
        f"(logs in {RunDir(run_dir).logs})"
    )
    with _service() as stack:
        replicas = LocalReplicaSet(
            replica_launch_config_of(
                config, model_dir, RunDir(run_dir).logs, _placed(config, model_dir)
            )
        )
        stack.callback(replicas.stop)
        try:
            replicas.start()
        except KeyboardInterrupt:
            return 0
        for url in replicas.urls:
            _emit("replica_url", url)
        _say(
            f"serving; use them with --set 'replicas.urls=[{', '.join(replicas.urls)}]'. "
            "Ctrl-C or SIGTERM stops them"
        )
        return _serve_until_stopped(_children_of(replicas))


def _gateway(config: RunConfig) -> int:
    section = config.gateway
    if section.url is not None:
        raise DeployError(
            "gateway.url names a gateway running elsewhere; `lockgate gateway` serves one here "
            "(set gateway.host and gateway.port)"
        )
    check_model_dir(config.model.path)
    check_port_free(section.host, section.port, "gateway.port")
    urls = config.replicas.urls
    if urls:
        check_replicas(urls, config.replicas.startup_timeout_s)
    token, made = _admin_token(section)
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    gateway_config = gateway_config_of(config, _model_dir(config), urls, run_dir, token)
    port = section.port or free_port(client_host(section.host))
    url = f"http://{client_host(section.host)}:{port}"

    def ready() -> None:
        _emit("gateway_url", url)
        if made:
            _emit("admin_token", token)
        _say(
            f"gateway serving at {url} in front of {len(urls)} replica(s)"
            + ("" if urls else " (add them with POST /admin/replicas)")
            + f"; trajectories in {gateway_config.db_path}. Ctrl-C or SIGTERM stops it"
        )

    from lockgate.gateway.api.server import configure_logging, serve  # the app: slow to import

    configure_logging()
    # uvicorn stops on SIGINT or SIGTERM, then raises the signal again for the handler it
    # found: here a KeyboardInterrupt, so that a stop is a clean exit (0), not a death by signal.
    with _service():
        try:
            serve(gateway_config, section.host, port, on_ready=ready)
        except KeyboardInterrupt:
            pass
    _say("gateway stopped")
    return 0


def _serve(config: RunConfig) -> int:
    section = config.gateway
    if section.url is not None:
        raise DeployError(
            "gateway.url names a gateway running elsewhere; `lockgate serve` starts one here"
        )
    check_model_dir(config.model.path)
    check_port_free(section.host, section.port, "gateway.port")
    if config.replicas.urls:
        check_replicas(config.replicas.urls, config.replicas.startup_timeout_s)
    else:
        check_replica_ports(config.replicas)
    token, made = _admin_token(section)
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(config)
    with _service() as stack:
        children: list[_Child] = []
        urls = config.replicas.urls
        try:
            if not urls:
                _say(
                    f"starting {config.replicas.count} vLLM replica(s) of {model_dir} "
                    f"(logs in {RunDir(run_dir).logs})"
                )
                replicas = LocalReplicaSet(
                    replica_launch_config_of(
                        config, model_dir, RunDir(run_dir).logs, _placed(config, model_dir)
                    )
                )
                stack.callback(replicas.stop)
                replicas.start()
                urls, children = replicas.urls, _children_of(replicas)
            gateway = GatewayProcess(
                gateway_config_of(config, model_dir, urls, run_dir, token),
                run_dir,
                port=section.port,
                host=section.host,
            )
            stack.callback(gateway.stop)
            gateway.start(section.startup_timeout_s)
        except KeyboardInterrupt:
            return 0
        assert gateway.process is not None
        children.append(_Child(f"the gateway ({gateway.url})", gateway.process, gateway.log_path))
        for url in urls:
            _emit("replica_url", url)
        _emit("gateway_url", gateway.url)
        if made:
            _emit("admin_token", token)
        _say(
            f"serving at {gateway.url}; trajectories in {RunDir(run_dir).store}, logs "
            f"in {RunDir(run_dir).logs}. Sessions: `lockgate session new --gateway {gateway.url}` "
            f"with ${section.admin_token_env} set, or POST /admin/sessions. Ctrl-C or SIGTERM "
            "stops it all"
        )
        return _serve_until_stopped(children)
