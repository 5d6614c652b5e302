"""When a supervised run stops before its planned steps, and whether it reached what it was
required to: pure rules over the recorded held-out checks (loss and exact match) and the
training loss of each step.

Every rank reaches the same answer from the same all-reduced losses, so they stop together; a
resumed run feeds the losses recorded up to its checkpoint and, if the run had stopped there,
stays stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

from lockgate.trainer.sft.config import PlateauStop, SFTLoopSection


def plateaued(losses: Sequence[float], rule: PlateauStop) -> bool:
    """Whether `losses` (oldest first) have plateaued under `rule`: once one was at or below
    `rule.below`, the last `rule.patience` set no best `rule.min_improvement` below the one
    before."""
    best, since, armed = float("inf"), 0, False
    for loss in losses:
        if loss < best * (1 - rule.min_improvement):
            best, since = loss, 0
        else:
            since += 1
        armed = armed or loss <= rule.below
    return armed and since >= rule.patience


def windowed_loss(steps: Sequence[tuple[float, float]], window: int) -> float | None:
    """The token-weighted mean of the last `window` steps' `(loss, trained tokens)`; None
    before there are that many."""
    if len(steps) < window:
        return None
    last = steps[-window:]
    tokens = sum(t for _, t in last)
    return sum(loss * t for loss, t in last) / tokens if tokens else None


def stop_reason(
    losses: Sequence[float],
    loop: SFTLoopSection,
    steps: Sequence[tuple[float, float]] = (),
    exact: Sequence[float] = (),
) -> str | None:
    """Why the run stops after the last of `losses` (held-out), `steps` (each step's training
    loss and trained tokens) and `exact` (held-out exact match, one per held-out check), or
    None to go on."""
    if loop.stop_at_train_loss is not None:
        mean = windowed_loss(steps, loop.train_loss_window)
        if mean is not None and mean <= loop.stop_at_train_loss:
            return (
                f"training loss over the last {loop.train_loss_window} steps {mean:.4f}, at or "
                f"below {loop.stop_at_train_loss}"
            )
    target = loop.stop_at_val_exact_match
    if target is not None and exact and exact[-1] >= target:
        return f"held-out exact match {exact[-1]:.3f}, at or above {target}"
    if not losses:
        return None
    if loop.stop_at_val_loss is not None and losses[-1] <= loop.stop_at_val_loss:
        return f"held-out loss at or below {loop.stop_at_val_loss}"
    rule = loop.stop_on_plateau
    if rule is not None and plateaued(losses, rule):
        return (
            f"held-out loss plateaued: best {min(losses):.4f}, no new best "
            f"{rule.min_improvement:.0%} lower in {rule.patience} checks"
        )
    return None


def requirement_missed(
    losses: Sequence[float], exact: Sequence[float], loop: SFTLoopSection, step: int
) -> str | None:
    """Why a run that ended at `step` fails `loop.require` (one line), or None when it holds
    or nothing is required. Judged on the last held-out check, the one the final model had."""
    if loop.require is None:
        return None
    if loop.require == "val_exact_match":
        target, values, name = loop.stop_at_val_exact_match, exact, "held-out exact match"
        reached = bool(values) and target is not None and values[-1] >= target
    else:
        target, values, name = loop.stop_at_val_loss, losses, "held-out loss"
        reached = bool(values) and target is not None and values[-1] <= target
    if reached:
        return None
    last = f"{values[-1]:.3f}" if values else "never measured"
    return (
        f"{name} {last} when the run ended at step {step}, short of "
        f"loop.stop_at_{loop.require} {target} (loop.require: {loop.require})"
    )
