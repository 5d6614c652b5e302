"""The toy example's reward, and what loading it brings into the coordinator's process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]

_LOAD = """
import sys
from pathlib import Path
from lockgate.coordinator.config import EnvironmentSection
from lockgate.coordinator.launch.local import load_environment
env = load_environment(
    EnvironmentSection(path=Path(sys.argv[1])), Path(sys.argv[2]), Path(sys.argv[3])
)
print(sorted(env.number_tokens))
print(sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules))
"""


def test_the_number_tokens_are_those_transformers_decodes_to_digits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    expected = [
        i
        for i in range(len(tokenizer))
        if (text := tokenizer.decode([i])).strip() and all(c.isdigit() or c.isspace() for c in text)
    ]
    assert expected  # the tiny tokenizer has digit tokens, or the reward could never rise
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD,
            str(ROOT / "examples/toy/env.py"),
            str(tiny_model_dir),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0] == str(expected)
    # The coordinator runs the environment: torch there (via transformers) meant ~1 s more
    # start-up and triton's leak report on every exit.
    assert out[1] == "[]"
