"""The trainer's pure pieces against hand-computed references (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from lockgate.trainer.batch import TrainSample
from lockgate.trainer.loss import ppo_clip_loss, sample_weights, token_logprobs
from lockgate.trainer.micro_batches import assign_to_ranks, plan_micro_batches


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


def test_ppo_clip_loss_by_hand() -> None:
    # One sequence, three trained tokens plus an untrained first one.
    old = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    new = torch.tensor([[0.0, -1.0, -0.5, -2.0]])  # ratios 1, e^0.5 = 1.6487, e^-1 = 0.3679
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    terms = ppo_clip_loss(
        new, old, adv, mask, torch.tensor([1 / 3]), clip_eps_low=0.2, clip_eps_high=0.28
    )
    # token 1: ratio 1 -> -1. token 2: min(1.6487, 1.28) * 1 -> -1.28 (clipped).
    # token 3: A < 0: -min(-0.3679, -0.8) = 0.8 (clipped at 1 - 0.2).
    expected = (-1.0 - 1.28 + 0.8) / 3
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.clipped.item() == 2
    assert terms.tokens.item() == 3
    ratios = [1.0, math.exp(0.5), math.exp(-1.0)]
    assert terms.ratio_sum.item() == pytest.approx(sum(ratios), abs=1e-5)
    assert terms.ratio_max.item() == pytest.approx(math.exp(0.5), abs=1e-5)
    k3 = sum(r - 1 - math.log(r) for r in ratios)
    assert terms.mismatch_kl_sum.item() == pytest.approx(k3, abs=1e-5)


def test_ppo_gradient_vanishes_on_clipped_tokens() -> None:
    new = torch.tensor([[0.0, -0.5]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0]])  # ratio 1.65 > 1.28 with A > 0: clipped, no gradient
    terms = ppo_clip_loss(
        new,
        old,
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([1.0]),
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    terms.loss.backward()
    assert new.grad is not None and torch.all(new.grad == 0)


def test_ranks_get_balanced_token_loads() -> None:
    lengths = [100, 90, 10, 10, 50, 40]
    ranks = assign_to_ranks(lengths, 2)
    assert sorted(i for r in ranks for i in r) == list(range(6))
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 10
    assert assign_to_ranks([5], 2) == [[0], []]


def test_micro_batches_fit_the_padded_budget() -> None:
    lengths = [30, 10, 20, 25, 100]
    plan = plan_micro_batches(lengths, 60)
    assert sorted(i for mb in plan for i in mb) == list(range(5))
    assert plan[0] == [4]  # longer than the budget: alone, not truncated
    for mb in plan[1:]:
        assert max(lengths[i] for i in mb) * len(mb) <= 60


def test_a_misaligned_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSample(input_ids=[1, 2], loss_mask=[0], rollout_logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match="first token"):
        TrainSample(input_ids=[1, 2], loss_mask=[1, 1], rollout_logprobs=[0, 0], advantages=[0, 0])
