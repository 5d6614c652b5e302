"""The CPU recipe's configs against each other and against prepare.py's defaults.

The recipe's choices hold only together: the drills' stop reads a held-out loss only when no
drill is seen twice, and the SFT's learning rate must reach its floor within the one pass that
prepare.py's transcripts make. These checks load the files run_cpu.sh runs, as `lockgate sft`
and `lockgate train` load them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate.coordinator.config import load_config, read_config_file
from lockgate.examples.deepresearch.prepare import arguments
from lockgate.trainer.sft.config import SFTConfig

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "deepresearch" / "configs"


def _sft(name: str) -> SFTConfig:
    return SFTConfig.model_validate(read_config_file(CONFIGS / name, []))


def _defaults() -> dict[str, int]:
    return vars(arguments().parse_args(["--out", "unused"]))


def test_drills_stop_when_they_copy_and_stop_the_recipe_when_they_never_do() -> None:
    drills = _sft("drill_cpu.yaml")
    # Judged by whether the held-out drills are copied exactly, not by a loss, and required:
    # drills that reach their cap without copying stop the recipe (issue 45).
    assert drills.loop.stop_at_val_exact_match is not None
    assert drills.loop.require == "val_exact_match"
    assert drills.loop.stop_at_train_loss is None and drills.loop.stop_at_val_loss is None
    assert drills.loop.val_every > 0
    # One pass over drills each seen once: the cap is the data, not a step count.
    assert drills.loop.epochs == 1 and drills.loop.max_steps is None
    steps = _defaults()["drills"] // drills.loop.batch_size
    assert drills.loop.val_every * 10 <= steps  # many checks before the cap


def test_sft_decays_within_its_one_pass() -> None:
    sft = _sft("sft_cpu.yaml")
    steps = _defaults()["sft_train"] // sft.loop.batch_size
    assert sft.loop.epochs == 1
    assert sft.trainer.decay_steps is not None
    assert sft.trainer.warmup_steps < sft.trainer.decay_steps <= steps
    assert sft.loop.val_every <= steps  # at least one validation before the last step's


@pytest.mark.parametrize("name", ["rl_cpu.yaml", "rl_gpu.yaml"])
def test_rl_configs_load(name: str) -> None:
    config = load_config(CONFIGS / name)
    assert config.environment.path is not None and config.environment.path.is_file()
