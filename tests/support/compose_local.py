"""A compose file's services run as local processes: for testing docker-compose.yml on a machine
where no container can run.

What it takes from the file is what a container would run: each service's `command` and
`environment` after compose's variable substitution from an env file, started in `depends_on`
order, each dependency's condition awaited (`service_healthy`: the service's own healthcheck
`test` command, run until it passes). What only a container has is mapped, never rewritten by
hand: a volume's mount point becomes a directory under the test's tmp dir (a volume mounted
inside another one is linked into place), a service's name or network alias in a URL becomes
127.0.0.1, and the image's working directory is the repository (the images hold it at /app).
Keys this module does not know make `check_known_keys` fail, so nothing the containers would
do differently slips past the test.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Keys emulated here, and keys that only shape the container (image, ports, resources).
EMULATED = {"command", "environment", "volumes", "depends_on", "healthcheck", "profiles"}
CONTAINER_ONLY = {
    "image",
    "build",
    "ports",
    "shm_size",
    "ipc",
    "deploy",
    "restart",
    "networks",
    "init",
}

_VAR = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?$", re.S)


class ComposeError(ValueError):
    pass


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: `$V`, `${V}`, `${V:-default}`, `${V-default}`,
    `${V:?error}`, `${V?error}` (a ComposeError), `$$` for a literal `$`."""

    def one(match: re.Match[str]) -> str:
        if match.group("dollar"):
            return "$"
        if match.group("named"):
            return env.get(match.group("named"), "")
        parsed = _BRACED.match(match.group("braced"))
        if parsed is None:
            raise ComposeError(f"bad substitution: {match.group(0)}")
        name, op, arg = parsed.group("name"), parsed.group("op"), parsed.group("arg")
        got = env.get(name)
        if op == ":-":
            return got if got else interpolate(arg, env)
        if op == "-":
            return got if got is not None else interpolate(arg, env)
        if op in (":?", "?") and (got is None or (op == ":?" and not got)):
            raise ComposeError(f"{name}: {arg}")
        return got or ""

    return _VAR.sub(one, value)


def _substitute(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_substitute(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _substitute(value, env) for key, value in node.items()}
    return node


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=value` lines (comments, blank lines and surrounding quotes as compose reads them)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ComposeError(f"{path}: not KEY=value: {line}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def compose_variables(env_file: Path, shell: Mapping[str, str]) -> dict[str, str]:
    """The variables compose substitutes: the .env file's, and the shell's, which win."""
    return {**read_env_file(env_file), **shell}


def load_compose(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """The compose file with YAML anchors and merges resolved and variables substituted."""
    raw = yaml.safe_load(path.read_text())
    top = {key: value for key, value in raw.items() if not key.startswith("x-")}
    return _substitute(top, env)  # type: ignore[no-any-return]


def services_of(compose: dict[str, Any], profiles: set[str]) -> dict[str, dict[str, Any]]:
    """The services enabled by `profiles` (those without profiles always are)."""
    return {
        name: spec
        for name, spec in compose["services"].items()
        if not spec.get("profiles") or profiles & set(spec["profiles"])
    }


def check_known_keys(services: Mapping[str, dict[str, Any]]) -> None:
    for name, spec in services.items():
        unknown = set(spec) - EMULATED - CONTAINER_ONLY
        if unknown:
            raise ComposeError(f"service {name}: keys not emulated here: {sorted(unknown)}")


def dependencies(spec: dict[str, Any]) -> dict[str, str]:
    """`depends_on` as {service: condition}."""
    deps = spec.get("depends_on") or {}
    if isinstance(deps, list):
        return {dep: "service_started" for dep in deps}
    return {
        dep: (options or {}).get("condition", "service_started") for dep, options in deps.items()
    }


def start_order(services: Mapping[str, dict[str, Any]]) -> list[str]:
    """Every service after the ones it depends on (a dependency outside `services` or a cycle
    is an error, as it is for compose)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ComposeError(f"depends_on cycle through {name}")
        if name not in services:
            raise ComposeError(f"depends on {name}, which is not enabled")
        visiting.add(name)
        for dep in dependencies(services[name]):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


@dataclass
class LocalMap:
    """Where container paths and service host names lie on this machine."""

    paths: dict[str, Path] = field(default_factory=dict)  # mount point -> local directory
    hosts: set[str] = field(default_factory=set)

    def apply(self, text: str) -> str:
        for target in sorted(self.paths, key=len, reverse=True):
            text = re.sub(
                rf"(?<![\w/.-]){re.escape(target)}(?=/|$|[^\w.-])", str(self.paths[target]), text
            )
        for host in sorted(self.hosts, key=len, reverse=True):
            text = re.sub(rf"(?<=://){re.escape(host)}(?=[:/]|$)", "127.0.0.1", text)
        return text


def local_mapping(services: Mapping[str, dict[str, Any]], root: Path) -> LocalMap:
    """Volumes and bind mounts as directories under `root` (one per volume, the same for every
    service that mounts it; a mount point inside another is a link to its volume's directory),
    service names and aliases as hosts."""
    sources: dict[str, str] = {}
    for spec in services.values():
        for volume in spec.get("volumes", []):
            source, target = volume.split(":")[:2]
            if sources.setdefault(target, source) != source:
                raise ComposeError(f"{target}: mounted from {source} and {sources[target]}")
    mapping = LocalMap()
    for target in sorted(sources, key=len):
        source = sources[target]
        kind = "binds" if source.startswith((".", "/", "~")) else "volumes"
        local = root / kind / (re.sub(r"[^\w.-]+", "_", source.strip("./~")) or "root")
        local.mkdir(parents=True, exist_ok=True)
        parent = next(
            (p for p in sorted(mapping.paths, key=len, reverse=True) if target.startswith(p + "/")),
            None,
        )
        if parent is not None:
            link = mapping.paths[parent] / target[len(parent) + 1 :]
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(local, target_is_directory=True)
        mapping.paths[target] = local
    for name, spec in services.items():
        mapping.hosts.add(name)
        for network in (spec.get("networks") or {}).values():
            mapping.hosts.update((network or {}).get("aliases", []))
    return mapping


def argv_of(command: str | list[str], mapping: LocalMap) -> list[str]:
    words = shlex.split(command) if isinstance(command, str) else [str(w) for w in command]
    return [mapping.apply(word) for word in words]


def healthcheck_argv(spec: dict[str, Any], mapping: LocalMap) -> list[str] | None:
    test = (spec.get("healthcheck") or {}).get("test")
    if test is None or test == ["NONE"]:
        return None
    if isinstance(test, str):
        return ["/bin/sh", "-c", mapping.apply(test)]
    kind, *rest = test
    if kind == "CMD-SHELL":
        return ["/bin/sh", "-c", mapping.apply(rest[0])]
    if kind != "CMD":
        raise ComposeError(f"healthcheck test {test!r}")
    return [mapping.apply(word) for word in rest]


@dataclass
class LocalService:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    health: list[str] | None
    env: dict[str, str]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def healthy(self) -> bool:
        if self.health is None:
            return True
        result = subprocess.run(self.health, env=self.env, capture_output=True, timeout=30)
        return result.returncode == 0

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until its healthcheck passed; an error if it exits or times out first."""
        started = time.monotonic()
        while True:
            if self.healthy():
                return time.monotonic() - started
            code = self.proc.poll()
            if code is not None:
                raise ComposeError(f"{self.name} exited ({code}):\n{self.log_tail()}")
            if time.monotonic() - started > timeout_s:
                raise ComposeError(f"{self.name} not healthy in {timeout_s}s:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM, as `docker compose stop` sends it; its exit code (the group killed after)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class LocalStack:
    """`with LocalStack(services, mapping, base_env, cwd, log_dir) as stack: stack.up()`."""

    def __init__(
        self,
        services: Mapping[str, dict[str, Any]],
        mapping: LocalMap,
        base_env: Mapping[str, str],
        cwd: Path,
        log_dir: Path,
        health_timeout_s: float = 900,
    ) -> None:
        check_known_keys(services)
        self.services = dict(services)
        self.mapping = mapping
        self.base_env = dict(base_env)
        self.cwd = cwd
        self.log_dir = log_dir
        self.health_timeout_s = health_timeout_s
        self.running: dict[str, LocalService] = {}
        self.timings: dict[str, float] = {}

    def environment(self, name: str) -> dict[str, str]:
        env = self.services[name].get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        return {
            **self.base_env,
            **{key: self.mapping.apply("" if v is None else str(v)) for key, v in env.items()},
        }

    def start(self, name: str) -> LocalService:
        spec = self.services[name]
        for dep, condition in dependencies(spec).items():
            started = time.monotonic()
            if condition == "service_healthy":
                self.running[dep].wait_healthy(self.health_timeout_s)
            elif condition == "service_completed_successfully":
                code = self.running[dep].proc.wait(timeout=self.health_timeout_s)
                if code != 0:
                    raise ComposeError(f"{dep} exited {code}:\n{self.running[dep].log_tail()}")
            self.timings[f"{name} waited for {dep}"] = time.monotonic() - started
        env = self.environment(name)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv_of(spec["command"], self.mapping),
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        service = LocalService(name, proc, log_path, healthcheck_argv(spec, self.mapping), env)
        self.running[name] = service
        return service

    def up(self) -> list[str]:
        """Start every service in dependency order; the order."""
        order = start_order(self.services)
        for name in order:
            self.start(name)
        return order

    def down(self) -> dict[str, int]:
        """Stop in reverse order; each service's exit code."""
        return {name: self.running[name].stop() for name in reversed(list(self.running))}

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(list(self.running)):
            service = self.running[name]
            if service.proc.poll() is None:
                service.stop(timeout_s=60)
