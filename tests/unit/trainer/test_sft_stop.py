"""When `lockgate sft` stops early, and when it fails what it was required to reach: the rules
over held-out checks and training losses (trainer/sft/stop.py)."""

from __future__ import annotations

import pytest

from lockgate.trainer.sft.config import PlateauStop, SFTConfig, SFTLoopSection
from lockgate.trainer.sft.stop import plateaued, requirement_missed, stop_reason, windowed_loss

# Seed 0's copy drills of the DeepResearch CPU recipe, every 50 steps from step 50: a long
# first plateau near 2.6-3.4, a fall, then 0.08-0.11 until the 1,200-step cap.
SEED0_DRILLS = [3.392, 2.954, 2.739, 2.484, 1.925, 1.259, 0.878, 0.721, 0.563, 0.405, 0.229]
SEED0_DRILLS += [0.167, 0.117, 0.094, 0.092, 0.082, 0.089, 0.112, 0.099, 0.091, 0.091, 0.096]
RULE = PlateauStop(below=0.15, patience=3, min_improvement=0.1)


def _first_stop(losses: list[float], rule: PlateauStop) -> int | None:
    return next((n for n in range(1, len(losses) + 1) if plateaued(losses[:n], rule)), None)


def test_seed_0s_drills_stop_three_checks_after_their_last_ten_percent_gain() -> None:
    # 0.082 at step 800 is the last best 10% under the one before (0.094); 850, 900 and 950
    # set none, so the run stops at step 950 instead of 1,200.
    assert _first_stop(SEED0_DRILLS, RULE) == 19  # the 19th check: step 950


def test_the_first_plateau_does_not_stop_a_run_that_has_not_fallen() -> None:
    # Near 2.6 for many checks: never at or below `below`, so never armed.
    flat = [2.70, 2.65, 2.66, 2.64, 2.65, 2.66, 2.63]
    assert _first_stop(flat, RULE) is None
    assert _first_stop(flat, RULE.model_copy(update={"below": 3.0})) == 4


def test_a_loss_falling_ten_percent_over_three_checks_goes_on() -> None:
    # 4% a check: 0.96**3 = 0.885, so every third check is a new best and the run goes on.
    slow = [0.1 * 0.96**n for n in range(20)]
    assert _first_stop(slow, RULE) is None
    # 3% a check: 0.97**3 = 0.913, never 10% under the last best in three checks.
    assert _first_stop([0.1 * 0.97**n for n in range(20)], RULE) == 4


def test_small_gains_do_not_reset_the_count() -> None:
    # Each check a little lower, none 10% under the best that counted (0.100).
    assert _first_stop([0.100, 0.097, 0.094, 0.092], RULE) == 4


def test_the_target_comes_first_and_a_loop_without_rules_never_stops() -> None:
    both = SFTLoopSection(stop_at_val_loss=0.03, stop_on_plateau=RULE)
    assert stop_reason([0.1, 0.05, 0.02], both) == "held-out loss at or below 0.03"
    assert stop_reason(SEED0_DRILLS[:19], both) == (
        "held-out loss plateaued: best 0.0820, no new best 10% lower in 3 checks"
    )
    assert stop_reason(SEED0_DRILLS[:18], both) is None
    assert stop_reason(SEED0_DRILLS, SFTLoopSection()) is None
    assert stop_reason([], both) is None


def test_the_training_loss_window_is_token_weighted_and_waits_to_be_full() -> None:
    steps = [(9.0, 100.0), (0.5, 10.0), (0.1, 30.0)]
    assert windowed_loss(steps, 4) is None
    assert windowed_loss(steps, 2) == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)  # 0.2, not 0.3
    assert windowed_loss([(1.0, 0.0)], 1) is None  # no trained token: nothing measured


def test_the_training_loss_stop_fires_on_its_window_before_any_held_out_rule() -> None:
    loop = SFTLoopSection(stop_at_train_loss=0.2, train_loss_window=2, stop_at_val_loss=0.03)
    steps = [(9.0, 100.0), (0.5, 10.0), (0.1, 30.0)]
    assert stop_reason([], loop, steps[:2]) is None  # window mean (9*100 + 0.5*10) / 110
    assert stop_reason([0.5], loop, steps) == (
        "training loss over the last 2 steps 0.2000, at or below 0.2"
    )
    # Without the rule the same steps stop nothing; the held-out target still works alone.
    assert stop_reason([0.5], SFTLoopSection(), steps) is None
    assert stop_reason([0.02], loop, steps[:2]) == "held-out loss at or below 0.03"


@pytest.mark.parametrize(
    "bad", [{"below": 0}, {"below": 1, "patience": 0}, {"below": 1, "min_improvement": 1}]
)
def test_rules_out_of_range_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PlateauStop.model_validate(bad)


def test_the_exact_match_stop_fires_on_the_last_check_at_or_above_its_target() -> None:
    loop = SFTLoopSection(stop_at_val_exact_match=0.95)
    assert stop_reason([2.0, 0.5], loop, exact=[0.0, 0.94]) is None
    assert stop_reason([2.0, 0.5, 0.4], loop, exact=[0.0, 0.94, 0.95]) == (
        "held-out exact match 0.950, at or above 0.95"
    )
    # One long example that holds a mean loss up costs exact match only its share.
    assert stop_reason([0.5], loop.model_copy(update={"stop_at_val_loss": 0.03}), exact=[0.97])
    assert stop_reason([0.5], SFTLoopSection(), exact=[1.0]) is None  # no rule, no stop


def test_a_required_target_missed_at_the_end_is_one_line_naming_the_rule() -> None:
    loop = SFTLoopSection(stop_at_val_exact_match=0.95, require="val_exact_match")
    assert requirement_missed([0.1], [0.96], loop, step=700) is None
    missed = requirement_missed([0.1, 0.08], [0.5, 0.81], loop, step=1200)
    assert missed == (
        "held-out exact match 0.810 when the run ended at step 1200, short of "
        "loop.stop_at_val_exact_match 0.95 (loop.require: val_exact_match)"
    )
    assert "\n" not in missed
    # Judged on the last check, the one the final model had, not the best.
    assert requirement_missed([0.1, 0.1], [0.96, 0.90], loop, step=10) is not None
    by_loss = SFTLoopSection(stop_at_val_loss=0.03, require="val_loss")
    assert requirement_missed([0.05, 0.02], [], by_loss, step=9) is None
    assert "held-out loss 0.050" in str(requirement_missed([0.02, 0.05], [], by_loss, step=9))
    assert "never measured" in str(requirement_missed([], [], by_loss, step=0))
    assert requirement_missed([9.0], [0.0], SFTLoopSection(), step=1) is None  # nothing asked


def test_a_requirement_needs_its_target_and_a_held_out_set() -> None:
    with pytest.raises(ValueError, match=r"needs loop\.stop_at_val_exact_match"):
        SFTLoopSection(require="val_exact_match")
    with pytest.raises(ValueError):
        SFTLoopSection(stop_at_val_exact_match=1.01)
    with pytest.raises(ValueError, match=r"loop\.stop_at_val_exact_match needs data\.val_path"):
        SFTConfig.model_validate(
            {"data": {"path": "x.jsonl"}, "loop": {"stop_at_val_exact_match": 0.9}}
        )
