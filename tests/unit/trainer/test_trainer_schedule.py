"""The learning-rate schedule against hand-computed multipliers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.schedule import learning_rate, lr_multiplier


def _mults(steps: range, **kw: object) -> list[float]:
    args: dict[str, object] = {
        "schedule": "constant",
        "warmup_steps": 0,
        "decay_steps": None,
        "min_lr_ratio": 0.0,
    }
    args.update(kw)
    return [lr_multiplier(k, **args) for k in steps]  # type: ignore[arg-type]


def test_constant_is_one_at_every_step() -> None:
    assert _mults(range(1, 6)) == [1.0] * 5


def test_warmup_is_linear_and_reaches_the_peak_on_its_last_step() -> None:
    assert _mults(range(1, 7), warmup_steps=4) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_after_warmup_to_the_floor() -> None:
    # warmup 2, then p = (k - 2) / 4 and 0.1 + 0.9 * (1 - p):
    # k=3: p=.25 -> .775; k=4: .55; k=5: .325; k=6: p=1 -> .1; k=9: stays .1
    got = _mults(range(1, 10), schedule="linear", warmup_steps=2, decay_steps=4, min_lr_ratio=0.1)
    assert got == pytest.approx([0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1, 0.1])


def test_cosine_decay_follows_the_half_cosine() -> None:
    # no warmup, decay over 4: 0.5 * (1 + cos(pi * k / 4))
    c = math.cos(math.pi / 4)  # 0.70711
    got = _mults(range(1, 6), schedule="cosine", decay_steps=4)
    assert got == pytest.approx([0.5 * (1 + c), 0.5, 0.5 * (1 - c), 0.0, 0.0], abs=1e-12)
    # with a floor of 0.2 the midpoint is 0.2 + 0.8 * 0.5
    assert _mults(range(2, 3), schedule="cosine", decay_steps=4, min_lr_ratio=0.2) == [
        pytest.approx(0.6)
    ]


def test_learning_rate_scales_the_configured_peak() -> None:
    config = TrainerConfig(
        model_dir=Path("m"), lr=1e-3, lr_schedule="cosine", warmup_steps=1, decay_steps=2
    )
    # step 1: warmup 1/1; step 2: p = 1/2 -> 0.5; step 3: p = 1 -> 0
    assert [learning_rate(config, k) for k in (1, 2, 3)] == pytest.approx([1e-3, 5e-4, 0.0])


def test_step_zero_is_not_a_trainer_step() -> None:
    with pytest.raises(ValueError, match="start at 1"):
        lr_multiplier(0, schedule="constant", warmup_steps=0, decay_steps=None, min_lr_ratio=0.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lr_schedule": "cosine"}, "needs decay_steps"),
        ({"lr_schedule": "linear"}, "needs decay_steps"),
        ({"decay_steps": 10}, "only applies to lr_schedule"),
        ({"lr_schedule": "step"}, "lr_schedule"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_schedule": "cosine", "decay_steps": 0}, "decay_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_bad_schedule_settings_raise_a_clear_value_error(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(model_dir=Path("m"), **fields)  # type: ignore[arg-type]
