"""The trainer's pure pieces against hand-computed references (CPU, fast)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lockgate.trainer import loss as loss_module
from lockgate.trainer.batch import TrainSample
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.loss import (
    LossInputs,
    LossSpec,
    LossTerms,
    behaviour_weights,
    policy_loss,
    sample_weights,
    token_entropy,
    token_logprobs,
)
from lockgate.trainer.micro_batches import assign_to_ranks, plan_micro_batches
from lockgate.trainer.step import split_mini_batches

SPEC = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28)


def _t(*rows: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float32, requires_grad=grad)


def test_token_logprobs_match_log_softmax_and_leave_the_first_position_zero() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    got = token_logprobs(logits, ids)
    assert got.shape == (2, 5)
    assert torch.all(got[:, 0] == 0)
    ref = torch.log_softmax(logits, -1)
    for b in range(2):
        for t in range(1, 5):
            assert got[b, t].item() == pytest.approx(ref[b, t - 1, ids[b, t]].item(), abs=1e-6)


def test_token_entropy_of_known_distributions() -> None:
    # Position t's entropy is that of the logits at t - 1 (what predicts token t).
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e4, -1e4], [0.0] * 4]])
    got = token_entropy(logits)
    assert got[0, 0].item() == 0.0
    assert got[0, 1].item() == pytest.approx(math.log(4), abs=1e-6)  # uniform over 4
    # p = (3/4, 1/4, 0, 0): H = -(0.75 ln 0.75 + 0.25 ln 0.25)
    assert got[0, 2].item() == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), abs=1e-6
    )


def test_chunked_logprobs_and_entropy_equal_one_pass_with_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over a large vocabulary the float32 work runs in checkpointed chunks of positions: the
    values and gradients must be those of one pass."""
    torch.manual_seed(0)
    base = torch.randn(3, 17, 50, dtype=torch.bfloat16)
    ids = torch.randint(0, 50, (3, 17))
    weights = torch.randn(3, 17)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = base.clone().requires_grad_(True)
        lp, ent = token_logprobs(logits, ids), token_entropy(logits)
        ((lp * weights).sum() + (ent * weights).sum()).backward()
        assert logits.grad is not None
        return lp.detach(), ent.detach(), logits.grad

    whole = run()
    assert loss_module._chunk_sizes(base[:, :-1]) == [16]
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 3 * 50 * 4)  # 4 positions per chunk
    assert loss_module._chunk_sizes(base[:, :-1]) == [4, 4, 4, 4]
    calls = []
    real = loss_module.checkpoint
    monkeypatch.setattr(loss_module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunked = run()
    assert len(calls) == 8  # both functions, four chunks each
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # no gradient wanted: plain chunks, nothing checkpointed
        assert torch.equal(token_logprobs(base, ids), whole[0])
    assert len(calls) == 8


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", [1 / 6, 1 / 6, 1 / 6]),
        ("seq-mean-token-mean", [1 / (1 * 2), 0.0, 1 / (5 * 2)]),
        ("seq-mean-token-sum", [1 / 2, 1 / 2, 1 / 2]),
    ],
)
def test_sample_weights_per_aggregation(agg: str, expected: list[float]) -> None:
    # Three samples with 1, 0 and 5 trained tokens: two sequences count.
    assert sample_weights([1, 0, 5], agg) == pytest.approx(expected)  # type: ignore[arg-type]


# -- bypass ------------------------------------------------------------------------------------


def test_bypass_ppo_clip_by_hand() -> None:
    # One sequence, three trained tokens plus an untrained first one whose (huge) ratio and
    # advantage must not leak into the loss or the extremes.
    old = _t([0.0, -1.0, -1.0, -1.0])
    new = _t([5.0, -1.0, -0.5, -2.0])  # ratios 1, e^0.5 = 1.6487, e^-1 = 0.3679
    adv = _t([9.0, 1.0, 1.0, -1.0])
    mask = _t([0.0, 1.0, 1.0, 1.0])
    terms = policy_loss(LossInputs(new, old, adv, mask, torch.tensor([1 / 3])), SPEC)
    # token 1: ratio 1 -> -1. token 2: min(1.6487, 1.28) * 1 -> -1.28 (clipped high).
    # token 3: A < 0: -min(-0.3679, -0.8) = 0.8 (clipped low, at 1 - 0.2).
    assert terms.loss.item() == pytest.approx((-1.0 - 1.28 + 0.8) / 3, abs=1e-6)
    assert (terms.clipped_low.item(), terms.clipped_high.item()) == (1, 1)
    assert terms.tokens.item() == 3
    ratios = [1.0, math.exp(0.5), math.exp(-1.0)]
    assert terms.ratio_sum.item() == pytest.approx(sum(ratios), abs=1e-5)
    assert terms.ratio_max.item() == pytest.approx(math.exp(0.5), abs=1e-5)
    assert terms.ratio_min.item() == pytest.approx(math.exp(-1.0), abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in ratios)
    assert terms.mismatch_kl_sum.item() == pytest.approx(k3, abs=1e-5)
    # bypass has no behaviour weight: 1 everywhere, nothing truncated
    assert terms.is_weight_sum.item() == 3
    assert terms.tis_truncated.item() == 0


def test_bypass_gradient_vanishes_on_clipped_tokens_only() -> None:
    new = _t([0.0, -0.5, -1.0], grad=True)
    old = _t([0.0, -1.0, -1.0])  # token 1: ratio 1.65 > 1.28 with A > 0: clipped
    terms = policy_loss(
        LossInputs(new, old, _t([0.0, 1.0, 1.0]), _t([0.0, 1.0, 1.0]), torch.tensor([0.5])), SPEC
    )
    terms.loss.backward()
    assert new.grad is not None
    # token 2: d/dlogp of -w * r * A = -0.5 * 1 * 1
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.5])


def test_tis_without_proximal_logprobs_is_refused() -> None:
    x = _t([0.0, -1.0])
    with pytest.raises(ValueError, match="proximal"):
        policy_loss(
            LossInputs(x, x, x, _t([0.0, 1.0]), torch.tensor([1.0])),
            LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, tis_level="token"),
        )


# -- decoupled ---------------------------------------------------------------------------------

# One sequence, three trained tokens.
_ROLLOUT = [0.0, -1.0, -2.0, -1.5]
_PROX = [0.0, -0.8, -2.3, -1.5]  # log b = 0.2, -0.3, 0.0
_THETA = [0.0, -0.3, -2.3, -1.9]  # log r = log(theta / prox) = 0.5, 0.0, -0.4
_ADV = [0.0, 1.0, -1.0, -1.0]
_MASK = [0.0, 1.0, 1.0, 1.0]


def _decoupled(spec: LossSpec) -> tuple[torch.Tensor, LossTerms]:
    theta = _t(_THETA, grad=True)
    terms = policy_loss(
        LossInputs(
            theta,
            _t(_ROLLOUT),
            _t(_ADV),
            _t(_MASK),
            torch.tensor([1 / 3]),
            proximal_logprobs=_t(_PROX),
        ),
        spec,
    )
    terms.loss.backward()
    return theta, terms


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_behaviour() -> None:
    theta, terms = _decoupled(SPEC)
    b = [math.exp(0.2), math.exp(-0.3), 1.0]
    # token 1: A = 1, r = e^0.5 = 1.6487 > 1.28: surrogate 1.28 -> loss -b1 * 1.28 (clipped high)
    # token 2: A = -1, r = 1: surrogate -1 -> loss +b2
    # token 3: A = -1, r = e^-0.4 = 0.6703 < 0.8: min(-0.6703, -0.8) = -0.8 -> loss +0.8 * b3
    expected = (-b[0] * 1.28 + b[1] * 1.0 + b[2] * 0.8) / 3
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.clipped_high.item() == 1
    assert terms.clipped_low.item() == 1
    assert terms.ratio_max.item() == pytest.approx(math.exp(0.5), abs=1e-6)
    assert terms.is_weight_sum.item() == pytest.approx(sum(b), abs=1e-6)
    # the mismatch is the start-of-step trainer (prox) against the rollout
    k3 = sum(w - 1 - math.log(w) for w in b)
    assert terms.mismatch_kl_sum.item() == pytest.approx(k3, abs=1e-6)
    # Only the unclipped token has a gradient: d/dlogp of -(1/3) * b2 * r2 * A2 = (1/3) * b2.
    assert theta.grad is not None
    assert theta.grad[0].tolist() == pytest.approx([0.0, 0.0, b[1] / 3, 0.0], abs=1e-6)


def test_decoupled_with_the_current_policy_as_proximal_is_importance_weighted_reinforce() -> None:
    # One update per batch: pi_prox is pi_theta detached, r = 1 and nothing is clipped however
    # far the rollout policy is; the gradient is -w * b * A per token.
    theta = _t([0.0, -1.0, -3.0], grad=True)
    rollout = _t([0.0, -2.0, -3.5])  # b = e^1, e^0.5
    terms = policy_loss(
        LossInputs(
            theta,
            rollout,
            _t([0.0, 1.0, -2.0]),
            _t([0.0, 1.0, 1.0]),
            torch.tensor([0.5]),
            proximal_logprobs=theta.detach(),
        ),
        SPEC,
    )
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(0.5 * (-math.e * 1.0 + math.exp(0.5) * 2.0), abs=1e-6)
    assert terms.clipped_low.item() + terms.clipped_high.item() == 0
    assert theta.grad is not None
    assert theta.grad[0].tolist() == pytest.approx([0.0, -0.5 * math.e, math.exp(0.5)], abs=1e-6)


def test_token_tis_truncates_each_behaviour_weight() -> None:
    _, terms = _decoupled(
        LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, tis_level="token", tis_cap=1.1)
    )
    b = [1.1, math.exp(-0.3), 1.0]  # e^0.2 = 1.2214 cut to 1.1; the others are below the cap
    expected = (-b[0] * 1.28 + b[1] * 1.0 + b[2] * 0.8) / 3
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.tis_truncated.item() == 1
    assert terms.is_weight_max.item() == pytest.approx(1.1, abs=1e-6)
    assert terms.is_weight_min.item() == pytest.approx(math.exp(-0.3), abs=1e-6)


def test_sequence_tis_uses_the_product_of_token_ratios_capped() -> None:
    # Sequence 0: log b = 0.2 - 0.3 + 0 = -0.1, so every token weighs e^-0.1 (under the cap).
    # Sequence 1: log b = 0.2 + 0.6 = 0.8, e^0.8 = 2.2255 > 2: every token weighs 2.
    prox = _t(_PROX, [0.0, -0.8, -1.4, 0.0])
    rollout = _t(_ROLLOUT, [0.0, -1.0, -2.0, 0.0])
    mask = _t(_MASK, [0.0, 1.0, 1.0, 0.0])
    got = behaviour_weights(prox, rollout, mask, level="sequence", cap=2.0)
    assert got.weights[0].tolist() == pytest.approx([math.exp(-0.1)] * 4, abs=1e-6)
    assert got.weights[1].tolist() == pytest.approx([2.0] * 4, abs=1e-6)
    assert got.truncated.tolist() == [[0.0] * 4, [0.0, 1.0, 1.0, 0.0]]

    _, terms = _decoupled(
        LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, tis_level="sequence", tis_cap=2.0)
    )
    w = math.exp(-0.1)
    assert terms.loss.item() == pytest.approx(w * (-1.28 + 1.0 + 0.8) / 3, abs=1e-6)
    assert terms.tis_truncated.item() == 0


def test_sequence_tis_does_not_overflow_on_long_sequences() -> None:
    # 400 tokens at log b = 0.5 each: the product e^200 overflows float32; the cap must win.
    n = 401
    prox = torch.zeros(1, n)
    rollout = torch.full((1, n), -0.5)
    mask = torch.ones(1, n)
    mask[0, 0] = 0
    got = behaviour_weights(prox, rollout, mask, level="sequence", cap=3.0)
    assert torch.all(got.weights == 3.0)
    assert got.truncated.sum().item() == n - 1


# -- KL penalty and entropy bonus --------------------------------------------------------------


def test_kl_penalty_is_k3_to_the_reference_with_its_gradient() -> None:
    theta = _t([0.0, -1.0, -2.0], grad=True)
    ref = _t([0.0, -1.5, -1.0])  # delta = ref - theta = -0.5, 1.0
    terms = policy_loss(
        LossInputs(
            theta,
            theta.detach(),  # rollout == theta: the policy term is -A = 0 with A = 0
            _t([0.0, 0.0, 0.0]),
            _t([0.0, 1.0, 1.0]),
            torch.tensor([0.5]),
            reference_logprobs=ref,
        ),
        LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.1),
    )
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]  # 0.10653, 0.71828
    assert terms.ref_kl_sum.item() == pytest.approx(sum(k3), abs=1e-6)
    assert terms.loss.item() == pytest.approx(0.1 * 0.5 * sum(k3), abs=1e-6)
    terms.loss.backward()
    # d/dtheta [exp(ref - theta) - (ref - theta) - 1] = 1 - exp(ref - theta)
    grads = [0.0] + [0.1 * 0.5 * (1 - math.exp(d)) for d in (-0.5, 1.0)]
    assert theta.grad is not None
    assert theta.grad[0].tolist() == pytest.approx(grads, abs=1e-6)


def test_kl_penalty_without_reference_logprobs_is_refused() -> None:
    x = _t([0.0, -1.0])
    with pytest.raises(ValueError, match="reference"):
        policy_loss(
            LossInputs(x, x, x, _t([0.0, 1.0]), torch.tensor([1.0])),
            LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.1),
        )


@pytest.mark.parametrize("coef", [0.01, -0.1])
def test_the_entropy_term_moves_the_loss_by_the_weighted_entropy(coef: float) -> None:
    """A positive coefficient is a bonus; a negative one a penalty, whose gradient descent lowers
    the entropy (entropy minimisation)."""
    theta = _t([0.0, -1.0, -1.0])
    entropy = _t([7.0, 2.0, 3.0], grad=True)  # position 0 is untrained: its 7 must not count
    terms = policy_loss(
        LossInputs(
            theta,
            theta,
            _t([0.0, 0.0, 0.0]),
            _t([0.0, 1.0, 1.0]),
            torch.tensor([0.5]),
            entropy=entropy,
        ),
        LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, entropy_coef=coef),
    )
    assert terms.loss.item() == pytest.approx(-coef * 0.5 * (2.0 + 3.0), abs=1e-7)
    assert terms.entropy_sum.item() == pytest.approx(5.0)
    terms.loss.backward()
    assert entropy.grad is not None
    assert entropy.grad[0].tolist() == pytest.approx([0.0, -coef * 0.5, -coef * 0.5])


# -- normalisation across ranks and micro-batches ----------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_splitting_a_batch_into_micro_batches_leaves_the_loss_unchanged(agg: str) -> None:
    torch.manual_seed(1)
    lengths, counts = [6, 4, 5], [5, 2, 3]
    mask = torch.zeros(3, 6)
    for s, (n, c) in enumerate(zip(lengths, counts, strict=True)):
        mask[s, n - c : n] = 1
    new, old, adv = torch.randn(3, 6) * 0.1 - 1, torch.randn(3, 6) * 0.1 - 1, torch.randn(3, 6)
    w = torch.tensor(sample_weights(counts, agg))  # type: ignore[arg-type]
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, entropy_coef=0.0)
    whole = policy_loss(LossInputs(new, old, adv, mask, w), spec).loss.item()
    parts = sum(
        policy_loss(LossInputs(new[i], old[i], adv[i], mask[i], w[i]), spec).loss.item()
        for i in ([0], [1, 2])
    )
    assert parts == pytest.approx(whole, abs=1e-6)
    # and the reference, by plain arithmetic, for token-mean: the mean over all 10 tokens
    if agg == "token-mean":
        per_token = []
        for s in range(3):
            for t in range(6):
                if mask[s, t]:
                    r = math.exp(new[s, t].item() - old[s, t].item())
                    a = adv[s, t].item()
                    per_token.append(-min(r * a, min(max(r, 0.8), 1.28) * a))
        assert whole == pytest.approx(sum(per_token) / 10, abs=1e-6)


# -- batching ----------------------------------------------------------------------------------


def test_ranks_get_balanced_token_loads() -> None:
    lengths = [100, 90, 10, 10, 50, 40]
    ranks = assign_to_ranks(lengths, 2)
    assert sorted(i for r in ranks for i in r) == list(range(6))
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 10
    assert assign_to_ranks([5], 2) == [[0], []]


def test_micro_batches_pack_up_to_the_token_budget() -> None:
    lengths = [30, 10, 20, 25, 100, 5]
    plan = plan_micro_batches(lengths, 60)
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    assert plan[0] == [4]  # longer than the budget: alone, not truncated
    # First fit from the longest: [30, 25, 5] and [20, 10] (padded, the first would be 3 x 30).
    assert plan[1:] == [[0, 3, 5], [2, 1]]
    assert all(sum(lengths[i] for i in mb) <= 60 for mb in plan[1:])


def test_mini_batches_are_contiguous_near_equal_slices() -> None:
    assert split_mini_batches(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_mini_batches(2, 1) == [[0, 1]]
    with pytest.raises(ValueError, match="fewer than mini_batches"):
        split_mini_batches(2, 3)


def test_a_misaligned_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSample(input_ids=[1, 2], loss_mask=[0], rollout_logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match="first token"):
        TrainSample(input_ids=[1, 2], loss_mask=[1, 1], rollout_logprobs=[0, 0], advantages=[0, 0])


# -- configuration -----------------------------------------------------------------------------


def test_defaults_keep_the_plain_objective() -> None:
    c = TrainerConfig(model_dir=Path("m"))
    assert (c.ppo_mode, c.tis_level, c.loss_agg, c.lr_schedule) == (
        "bypass",
        "none",
        "token-mean",
        "constant",
    )
    assert (c.kl_coef, c.entropy_coef, c.warmup_steps, c.mini_batches) == (0.0, 0.0, 0, 1)
    assert (c.checkpoint_every, c.resume, c.activation_checkpointing) == (0, False, False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tis_level": "token"}, "needs ppo_mode='decoupled'"),
        ({"ppo_mode": "decoupled", "tis_cap": 0.5}, "tis_cap"),
        ({"ppo_mode": "sometimes"}, "ppo_mode"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"mini_batches": 0}, "mini_batches"),
        ({"clip_eps_low": 1.0}, "clip_eps_low must be below 1"),
        ({"checkpoint_every": -1}, "checkpoint_every"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
    ],
)
def test_bad_loss_settings_raise_a_clear_value_error(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(model_dir=Path("m"), **fields)  # type: ignore[arg-type]
