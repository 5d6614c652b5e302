"""Who may import whom: every module's imports, read with `ast`, checked against one table.

The four components (docs/architecture.md): the trainer and the gateway import only themselves,
agent_runtime only the gateway's client and schema, the coordinator all of them. Examples may
import any component; no component imports an example. Inside the gateway, each room imports
only the rooms below it (gateway/__init__.py draws the picture), the code that runs inside
the vLLM replicas (vllm_ext) imports nothing of the gateway process's, and the viewer reaches
the store's records only through their pure parts (records/). The coordinator's rooms are
layers (top level <- metrics <- loop <- launch <- cli); the trainer's core imports none of its
rank programs (rl/, sft/). tests/ and benchmarks/ are not checked.

Every import statement counts, those inside functions and `if TYPE_CHECKING:` included;
imports made from strings (vLLM loading `--worker-extension-cls`) are not imports here.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Folder (relative to the repository root) -> the package it installs as (pyproject.toml).
FOLDERS = {
    "lockgate": "lockgate",
    "gateway": "lockgate.gateway",
    "agent_runtime": "lockgate.agent_runtime",
    "trainer": "lockgate.trainer",
    "coordinator": "lockgate.coordinator",
    "examples": "lockgate.examples",
}

G = "lockgate.gateway"
C = "lockgate.coordinator"
T = "lockgate.trainer"
AR = "lockgate.agent_runtime"
# The gateway's public surface and the foundation every room builds on: its top-level modules.
FOUNDATION = [f"{G}.config", f"{G}.schema", f"{G}.errors", f"{G}.metrics", f"{G}.aiohttp_transport"]
# The pure formats and arithmetic of what a run records (codecs, merging, advantages, the
# metrics file): the store writes them, the viewer and the coordinator read through them.
RECORDS = f"{G}.records"

# Room -> what its modules may import besides the modules of their own room. An entry that is
# itself a room allows that room's modules (not its sub-rooms: list those too); any other
# entry allows that module and what lies below it. A module belongs to the most specific room
# that names it or a package above it; `lockgate` alone may import nothing of ours.
RULES: dict[str, list[str]] = {
    "lockgate": [],
    "lockgate.examples": ["lockgate"],  # filled below: any room of any component
    # The trainer imports only itself; its core imports none of its rooms, and the rank
    # programs (rl/, sft/) only the core. The tiny models are built for tests and examples
    # and need nothing of the trainer.
    T: [],
    f"{T}.rl": [T],
    f"{T}.sft": [T],
    f"{T}.tiny_models": [],
    # agent_runtime: the gateway's client and schema only.
    AR: [f"{G}.client", f"{G}.schema"],
    # The gateway: its top-level modules (client, config, schema, errors, metrics, the
    # aiohttp transport and the package's door) build on the foundation only.
    # The config also names how a run computes advantages, so the viewer shows what was trained
    # on: a pure module that imports nothing of ours.
    G: [*FOUNDATION, f"{RECORDS}.advantages"],
    f"{G}.__main__": ["gateway:*"],  # `python -m lockgate.gateway`: starts the app
    RECORDS: FOUNDATION,
    f"{G}.store": [*FOUNDATION, RECORDS],
    # The gateway process knows two things of the replica side: the pause route's path and
    # the snapshot header's layout (both torch-free).
    f"{G}.replicas": [*FOUNDATION, f"{G}.vllm_ext.routes"],
    f"{G}.sync": [*FOUNDATION, f"{G}.replicas", f"{G}.vllm_ext.snapshot_header"],
    f"{G}.calls": [*FOUNDATION, f"{G}.replicas", f"{G}.store", RECORDS],
    # The other agent APIs' bodies and answers, translated to and from chat completions: pure.
    f"{G}.dialects": FOUNDATION,
    f"{G}.api": [
        *FOUNDATION,
        f"{G}.calls",
        f"{G}.dialects",
        f"{G}.replicas",
        f"{G}.store",
        f"{G}.sync",
        f"{G}.viewer",
        RECORDS,
    ],
    # The trajectory viewer reads the store's file with its own SQL, through the store's pure
    # parts (records) and never the store itself: it must not open a writer.
    f"{G}.viewer": [*FOUNDATION, RECORDS],
    # Loaded into vLLM's own processes: nothing of the gateway process's.
    f"{G}.vllm_ext": [],
    # The coordinator, in layers: its top level (config, errors, the run dir's layout) <-
    # metrics <- loop <- launch (<- launch.ray) <- cli. Each layer imports those to its left,
    # the gateway, agent_runtime and the trainer's core; never a layer to its right.
    C: ["gateway:*", AR, T],
    f"{C}.metrics": [C, "gateway:*", T],
    f"{C}.loop": [C, f"{C}.metrics", "gateway:*", AR, T],
    f"{C}.launch": [
        C,
        f"{C}.metrics",
        f"{C}.loop",
        f"{C}.launch.ray",
        "gateway:*",
        AR,
        T,
        f"{T}.tiny_models",
        f"{T}.sft",  # `lockgate sft` launches the SFT ranks on its resolved config and data
    ],
    f"{C}.launch.ray": [C, f"{C}.metrics", f"{C}.launch", "gateway:*", AR, T],
    f"{C}.cli": ["coordinator:*", "gateway:*", AR, "trainer:*"],
}


def _expand(entries: list[str]) -> list[str]:
    """`gateway:*` stands for every room of that component."""
    out: list[str] = []
    for entry in entries:
        if entry.endswith(":*"):
            top = f"lockgate.{entry[:-2]}"
            out += [room for room in RULES if _under(room, top)]
        else:
            out.append(entry)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


RULES["lockgate.examples"] = [room for room in RULES if room != "lockgate.examples"]
RULES = {room: _expand(entries) for room, entries in RULES.items()}


def room_of(module: str) -> str:
    return max((room for room in RULES if _under(module, room)), key=len)


def allowed(importer: str, target: str) -> bool:
    room = room_of(importer)
    if room_of(target) == room:
        return True
    return any(
        room_of(target) == entry if entry in RULES else _under(target, entry)
        for entry in RULES[room]
    )


def modules(root: Path, folders: dict[str, str]) -> dict[str, Path]:
    """Every module of ours under `root`: dotted name -> file."""
    found: dict[str, Path] = {}
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) of every import of ours in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from package import module` imports that module.
                sub = f"{base}.{alias.name}"
                out.append((node.lineno, sub if sub in known else base))
    return [(line, name) for line, name in out if _under(name, "lockgate")]


def violations(root: Path, folders: dict[str, str] = FOLDERS) -> list[str]:
    found = modules(root, folders)
    bad = []
    for module, path in found.items():
        for line, target in imports_of(module, path, set(found)):
            if not allowed(module, target):
                where = path.relative_to(root)
                bad.append(f"{where}:{line}: {module} ({room_of(module)}) imports {target}")
    return bad


def test_the_project_keeps_its_import_directions() -> None:
    assert violations(ROOT) == []


def test_every_installed_folder_is_checked() -> None:
    """A folder pyproject.toml installs but this test does not know would go unchecked."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    assert {folder: package for package, folder in package_dir.items()} == FOLDERS


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_wrong_import_is_caught_in_a_fixture_tree(tmp_path: Path) -> None:
    """A small tree shaped like the project, with wrong imports planted next to right ones."""
    doors = [
        "lockgate",
        "gateway",
        "gateway/api",
        "gateway/calls",
        "gateway/replicas",
        "gateway/store",
        "gateway/sync",
        "gateway/vllm_ext",
        "gateway/records",
        "gateway/viewer",
        "agent_runtime",
        "trainer",
        "trainer/rl",
        "trainer/sft",
        "coordinator",
        "coordinator/loop",
        "coordinator/launch",
        "coordinator/metrics",
        "coordinator/cli",
        "examples",
        "examples/demo",
    ]
    _write(tmp_path, {f"{door}/__init__.py": '"""A door."""\n' for door in doors})
    _write(
        tmp_path,
        {
            # Allowed: the foundation, a room below, the replica side's torch-free contract.
            "gateway/schema.py": "from lockgate.gateway.errors import GatewayError\n",
            "gateway/errors.py": "",
            "gateway/client.py": "from lockgate.gateway import schema\n",
            "gateway/store/db.py": "from lockgate.gateway.schema import CallRecord\n",
            "gateway/replicas/pool.py": "from lockgate.gateway.vllm_ext.routes import PAUSE\n",
            "gateway/sync/controller.py": "from lockgate.gateway.replicas import pool\n",
            "gateway/calls/pipeline.py": "from ..store import db\nfrom . import tokens\n",
            "gateway/calls/tokens.py": "",
            "gateway/api/app.py": "import lockgate.gateway.sync.controller\n",
            "gateway/vllm_ext/routes.py": "from lockgate.gateway.vllm_ext import load\n",
            "gateway/vllm_ext/load.py": "import torch\n",
            "agent_runtime/rollout.py": "from lockgate.gateway.client import GatewayClient\n",
            "coordinator/loop/training.py": "from lockgate.trainer import step\nimport lockgate.gateway\n",
            "trainer/step.py": "import torch\n",
            "coordinator/launch/local.py": "from lockgate.coordinator.loop import training\n",
            "coordinator/cli/train.py": "from lockgate.coordinator.launch import local\n",
            "coordinator/metrics/log.py": "from lockgate.gateway.records.merge import merge\n",
            "gateway/records/merge.py": "from lockgate.gateway.schema import CallRecord\n",
            "gateway/viewer/query.py": "from lockgate.gateway.records import merge\n",
            "trainer/rl/main.py": "from lockgate.trainer.step import train_step\n",
            "trainer/sft/main.py": "from lockgate.trainer import step\n",
            "examples/demo/env.py": "from lockgate.coordinator.loop.training import training as loop\n",
            # Wrong, one of each kind.
            "gateway/store/wrong.py": "from ..api import app\n",
            "gateway/replicas/wrong.py": "from lockgate.gateway.calls.pipeline import Call\n",
            "gateway/vllm_ext/wrong.py": "def f():\n    from lockgate.gateway.errors import E\n",
            "gateway/wrong.py": "from lockgate.gateway.replicas import pool\n",
            "agent_runtime/wrong.py": "from lockgate.gateway.api.app import create_app\n",
            "trainer/wrong.py": "from lockgate.gateway.schema import CallRecord\n",
            "coordinator/wrong.py": "import lockgate.examples.demo.env\n",
            # The rooms of the coordinator and the trainer, and the viewer's one edge.
            "coordinator/loop/wrong.py": "from lockgate.coordinator.launch import local\n",
            "coordinator/metrics/wrong.py": "from lockgate.coordinator.loop import training\n",
            "trainer/wrong_core.py": "from lockgate.trainer.rl import main\n",
            "trainer/sft/wrong.py": "from lockgate.trainer.rl.main import serve\n",
            "gateway/viewer/wrong.py": "from lockgate.gateway.store import db\n",
            "gateway/records/wrong.py": "from lockgate.gateway.store import db\n",
        },
    )
    assert sorted(violations(tmp_path)) == sorted(
        [
            "gateway/wrong.py:1: lockgate.gateway.wrong (lockgate.gateway) imports "
            "lockgate.gateway.replicas.pool",
            "gateway/replicas/wrong.py:1: lockgate.gateway.replicas.wrong (lockgate.gateway.replicas)"
            " imports lockgate.gateway.calls.pipeline",
            "gateway/store/wrong.py:1: lockgate.gateway.store.wrong (lockgate.gateway.store) imports "
            "lockgate.gateway.api.app",
            "gateway/vllm_ext/wrong.py:2: lockgate.gateway.vllm_ext.wrong (lockgate.gateway.vllm_ext)"
            " imports lockgate.gateway.errors",
            "agent_runtime/wrong.py:1: lockgate.agent_runtime.wrong (lockgate.agent_runtime) imports "
            "lockgate.gateway.api.app",
            "trainer/wrong.py:1: lockgate.trainer.wrong (lockgate.trainer) imports "
            "lockgate.gateway.schema",
            "coordinator/wrong.py:1: lockgate.coordinator.wrong (lockgate.coordinator) imports "
            "lockgate.examples.demo.env",
            "coordinator/loop/wrong.py:1: lockgate.coordinator.loop.wrong "
            "(lockgate.coordinator.loop) imports lockgate.coordinator.launch.local",
            "coordinator/metrics/wrong.py:1: lockgate.coordinator.metrics.wrong "
            "(lockgate.coordinator.metrics) imports lockgate.coordinator.loop.training",
            "trainer/wrong_core.py:1: lockgate.trainer.wrong_core (lockgate.trainer) imports "
            "lockgate.trainer.rl.main",
            "trainer/sft/wrong.py:1: lockgate.trainer.sft.wrong (lockgate.trainer.sft) imports "
            "lockgate.trainer.rl.main",
            "gateway/viewer/wrong.py:1: lockgate.gateway.viewer.wrong (lockgate.gateway.viewer) "
            "imports lockgate.gateway.store.db",
            "gateway/records/wrong.py:1: lockgate.gateway.records.wrong "
            "(lockgate.gateway.records) imports lockgate.gateway.store.db",
        ]
    )


def test_the_replica_side_classes_named_by_string_exist() -> None:
    """vLLM imports these from the strings the launcher passes: each names a class defined in
    the replica-side room (read with ast: importing the worker extension loads torch)."""
    from lockgate.gateway.sync.weights import SNAPSHOT_LOAD_EXTENSION
    from lockgate.gateway.vllm_ext.routes import REPLICA_ROUTES

    found = modules(ROOT, FOLDERS)
    for dotted in (SNAPSHOT_LOAD_EXTENSION, REPLICA_ROUTES):
        module, _, cls = dotted.rpartition(".")
        assert room_of(module) == f"{G}.vllm_ext", dotted
        tree = ast.parse(found[module].read_text())
        assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, dotted
