"""The learning-rate schedule as a pure function of the trainer step (no torch).

Because the multiplier depends on the step alone, the schedule has no state of its own: a
resumed trainer recovers it from the checkpoint's step, and every optimizer update of step k
(one per mini-batch) uses the same rate.
"""

from __future__ import annotations

import math

from lockgate.trainer.config import LrSchedule, TrainerConfig


def lr_multiplier(
    step: int,
    *,
    schedule: LrSchedule,
    warmup_steps: int,
    decay_steps: int | None,
    min_lr_ratio: float,
) -> float:
    """The factor applied to the peak learning rate at trainer step `step` (1-based).

    Warmup is linear and ends on the peak: step k <= W gets k / W, so step 1 already learns
    (a schedule that starts at 0 wastes the first batch). After warmup, decay progress is
    p = min((k - W) / decay_steps, 1): the last decay step reaches the floor and later steps
    stay there.
    """
    if step < 1:
        raise ValueError(f"trainer steps start at 1, got {step}")
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    if decay_steps is None:
        raise ValueError(f"lr_schedule {schedule!r} needs decay_steps")
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr_schedule {schedule!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def learning_rate(config: TrainerConfig, step: int) -> float:
    return config.lr * lr_multiplier(
        step,
        schedule=config.lr_schedule,
        warmup_steps=config.warmup_steps,
        decay_steps=config.decay_steps,
        min_lr_ratio=config.min_lr_ratio,
    )
