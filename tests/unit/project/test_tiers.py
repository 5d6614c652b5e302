"""Every test file lives in a tier's folder, which tests/conftest.py turns into its marker, and
every folder of tests/ is a package (a bare tests/vllm/ on sys.path would shadow vLLM)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TIERS

TESTS = Path(__file__).resolve().parents[2]


def test_every_test_file_is_in_a_tier_folder() -> None:
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], (
        f"move these into tests/<tier>/ (tests/__init__.py lists the tiers): {loose}"
    )
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - {*TIERS, "support"} == set()
    assert not list((TESTS / "support").rglob("test_*.py")), "support/ holds helpers, not tests"


def test_every_folder_is_a_package() -> None:
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    assert (
        sorted(str(f.relative_to(TESTS)) for f in folders if not (f / "__init__.py").exists()) == []
    )
