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


def test_drills_stop_on_a_loss_over_drills_not_seen_before() -> None:
    drills = _sft("drill_cpu.yaml")
    assert drills.loop.stop_at_train_loss is not None
    # One pass: every batch is new to the model when it is scored, so the training loss of
    # the last steps is a held-out loss. A second pass would judge drills already learnt.
    assert drills.loop.epochs == 1 and drills.loop.max_steps is None
    window = drills.loop.train_loss_window * drills.loop.batch_size
    assert window <= _defaults()["drills"]


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
