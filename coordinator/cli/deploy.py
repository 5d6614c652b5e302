"""The commands that run one part of lockgate each, as a service in the foreground:
`lockgate replicas`, `lockgate gateway`, `lockgate serve` (both, for agents without training),
and `lockgate session new` (a session on a running gateway).

Each takes the run config's own sections (model, replicas, gateway; a run config file works
as it is), layered: defaults < the file < `LOCKGATE_<SECTION>__<FIELD>` variables < `--set`.
Bad input is one line, `lockgate: ...`, exit 2, before anything starts (deploy_checks.py).
What a service prints on stdout is `name=value` lines (`replica_url=`, `gateway_url=`), once it
serves; its progress goes to stderr. Ctrl-C or SIGTERM stops it and everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from lockgate.coordinator.cli.errors import config_error, error
from lockgate.coordinator.config import (
    GatewaySection,
    ModelSection,
    ReplicasSection,
    RunConfig,
    describe_options,
    env_overrides,
    load_config,
)
from lockgate.coordinator.launch.deploy_checks import (
    DeployError,
    check_model_dir,
    check_port_free,
    check_replica_ports,
    check_replicas,
)
from lockgate.coordinator.launch.gateway import GatewayProcess, GatewayStartError
from lockgate.coordinator.launch.parts import (
    admin_token_of,
    gateway_config_of,
    new_admin_token,
    replica_launch_config_of,
    run_dir_of,
)
from lockgate.coordinator.launch.processes import client_host, free_port
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaStartError
from lockgate.coordinator.run_dir import RunDir

DEPLOY_COMMANDS = ("replicas", "gateway", "serve", "session")

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


def add_deploy_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`replicas`, `gateway`, `serve` and `session` under the `lockgate` parser."""
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
        parser.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override an option, e.g. gateway.port=8000",
        )
        parser.add_argument(
            "--run-dir", type=Path, help="logs and trajectories (default runs/NAME)"
        )
    session = sub.add_parser("session", help="sessions on a running gateway")
    actions = session.add_subparsers(dest="action", required=True)
    new = actions.add_parser(
        "new",
        help="create a session; print its OpenAI base URL and key",
        description="Create a session through the gateway's admin API (the admin token from "
        "$LOCKGATE_ADMIN_TOKEN) and print OPENAI_BASE_URL=, OPENAI_API_KEY= and "
        "LOCKGATE_SESSION_ID= lines: `export $(lockgate session new)` points any OpenAI SDK "
        "at it.",
    )
    new.add_argument("--gateway", help="gateway URL (default: $LOCKGATE_GATEWAY__URL)")
    new.add_argument("--task-id", default="manual", help="the session's task id")
    new.add_argument("--group-id", help="the session's group id (a GRPO group)")
    new.add_argument("--metadata", default="{}", help="a JSON object stored with the session")
    new.add_argument("--json", action="store_true", help="print the created session as JSON")


def overrides_with_env(overrides: list[str]) -> list[str]:
    """The `LOCKGATE_<SECTION>__<FIELD>` variables as overrides, then `overrides` (--set)."""
    return [*env_overrides(os.environ), *overrides]


def run_deploy_command(args: argparse.Namespace) -> int:
    if args.command == "session":
        return _session_new(args)
    try:
        config = load_config(args.config, overrides_with_env(args.set))
    except (ValueError, OSError) as exc:
        return config_error(args.config, exc)
    if args.run_dir is not None:
        config.run_dir = args.run_dir
    command = {"replicas": _replicas, "gateway": _gateway, "serve": _serve}[args.command]
    try:
        return command(config)
    except DeployError as exc:
        return error(str(exc))
    except (ReplicaStartError, GatewayStartError) as exc:
        return error(str(exc), 1)


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
    """Wait for Ctrl-C or SIGTERM (0), or for a child to exit (1, naming it)."""
    try:
        while True:
            for child in children:
                code = child.proc.poll()
                if code is not None:
                    return error(
                        f"{child.name} exited with code {code}; log {child.log_path}; "
                        "stopping the rest",
                        1,
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
            replica_launch_config_of(config, model_dir, RunDir(run_dir).logs)
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
                    replica_launch_config_of(config, model_dir, RunDir(run_dir).logs)
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


# -- lockgate session new --------------------------------------------------------------------------


def _session_new(args: argparse.Namespace) -> int:
    try:
        config = load_config(None, env_overrides(os.environ))
    except (ValueError, OSError) as exc:
        return config_error(None, exc)
    section = config.gateway
    if args.gateway is not None:
        try:
            section = GatewaySection.model_validate({**section.model_dump(), "url": args.gateway})
        except ValidationError as exc:
            return error(f"--gateway: {exc.errors()[0]['msg']}")
    if section.url is None:
        return error("session new needs the gateway's URL: --gateway URL or $LOCKGATE_GATEWAY__URL")
    token = admin_token_of(section)
    if token is None:
        return error(f"session new needs the gateway's admin token in ${section.admin_token_env}")
    try:
        metadata: Any = json.loads(args.metadata)
    except ValueError as exc:
        return error(f"--metadata: not JSON ({exc})")
    if not isinstance(metadata, dict):
        return error("--metadata: must be a JSON object")
    return asyncio.run(_create_session(section.url, token, args, metadata))


async def _create_session(
    url: str, token: str, args: argparse.Namespace, metadata: dict[str, Any]
) -> int:
    import httpx

    from lockgate.gateway.client import GatewayClient, GatewayClientError

    try:
        async with GatewayClient(url, token, timeout=30.0) as client:
            created = await client.create_session(args.task_id, args.group_id, metadata)
    except GatewayClientError as exc:
        if exc.status_code == 401:
            return error(f"the gateway at {url} refused the admin token")
        return error(f"the gateway at {url} refused the session: {exc.message}")
    except httpx.HTTPError as exc:
        return error(f"cannot reach the gateway at {url} ({type(exc).__name__}: {exc})", 1)
    if args.json:
        print(created.model_dump_json())
    else:
        _emit("OPENAI_BASE_URL", created.base_url)
        _emit("OPENAI_API_KEY", created.api_key)
        _emit("LOCKGATE_SESSION_ID", created.session_id)
    return 0
