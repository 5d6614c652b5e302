"""Micro-batches: packed (CUDA's way) or one sample at a time (CPU's), the same logits as running
each sample alone, no attention across samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from lockgate.trainer.model import (
    MIN_SHARED_PREFIX,
    common_prefix,
    forward_logits,
    load_policy,
    pad_batch,
)


@pytest.mark.parametrize("pack", [True, False])
def test_micro_batch_logits_equal_each_sample_run_alone(tiny_model_dir: Path, pack: bool) -> None:
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = load_policy(tiny_model_dir, device).eval()
    vocab = model.config.vocab_size
    samples = [torch.randint(0, vocab, (n,)).tolist() for n in (7, 19, 1, 12)]
    lengths = [len(s) for s in samples]
    ids = pad_batch(samples, torch.long, device)
    with torch.no_grad():
        packed = forward_logits(model, ids, lengths, pack=pack)
        alone = [model(input_ids=torch.tensor([s])).logits[0] for s in samples]
    assert packed.shape == (4, 19, vocab)
    for row, (n, ref) in enumerate(zip(lengths, alone, strict=True)):
        torch.testing.assert_close(packed[row, :n], ref, atol=1e-5, rtol=1e-5)
        assert torch.all(packed[row, n:] == 0)  # padding positions carry nothing


def test_a_later_sample_does_not_change_an_earlier_ones_logits(tiny_model_dir: Path) -> None:
    # The packed path's block-diagonal mask: changing sample 2 leaves sample 1 exactly as it was.
    model = load_policy(tiny_model_dir, torch.device("cpu")).eval()
    first = [5, 6, 7, 8]
    with torch.no_grad():
        a = forward_logits(
            model,
            pad_batch([first, [9, 10, 11]], torch.long, torch.device("cpu")),
            [4, 3],
            pack=True,
        )
        b = forward_logits(
            model,
            pad_batch([first, [12, 13, 14]], torch.long, torch.device("cpu")),
            [4, 3],
            pack=True,
        )
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[1, :3], b[1, :3])


@pytest.mark.parametrize("pack", [True, False])
def test_gradients_flow_through_the_forward(tiny_model_dir: Path, pack: bool) -> None:
    model = load_policy(tiny_model_dir, torch.device("cpu"))
    logits = forward_logits(
        model, pad_batch([[1, 2, 3], [4, 5]], torch.long, torch.device("cpu")), [3, 2], pack=pack
    )
    logits[1, 1].sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_a_shared_prefix_runs_once_with_the_logits_and_gradients_of_each_sample_alone(
    tiny_model_dir: Path,
) -> None:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = load_policy(tiny_model_dir, cpu)
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (MIN_SHARED_PREFIX + 8,)).tolist()
    samples = [prefix + torch.randint(0, vocab, (n,)).tolist() for n in (5, 17, 1)]
    lengths = [len(s) for s in samples]
    calls: list[int] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True
    )

    logits = forward_logits(model, pad_batch(samples, torch.long, cpu), lengths, pack=False)
    assert calls == [len(prefix), 5, 17, 1]  # the prefix once, then each sample's own tokens
    _weighted(logits, lengths).backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    alone = [model(input_ids=torch.tensor([s])).logits[0] for s in samples]
    for row, (n, ref) in enumerate(zip(lengths, alone, strict=True)):
        torch.testing.assert_close(logits[row, :n], ref, atol=1e-5, rtol=1e-5)
    _weighted(pad_sequence(alone, batch_first=True), lengths).backward()
    for shared, ref in zip(shared_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(shared, ref, atol=1e-5, rtol=1e-4)


def _weighted(logits: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    # A loss that reaches every position of every sample, each weighted differently.
    weights = torch.linspace(0.5, 1.5, logits.shape[-1])
    return sum((logits[i, :n] * weights).pow(2).mean() for i, n in enumerate(lengths))


def test_the_common_prefix_leaves_every_sample_a_token_of_its_own() -> None:
    t = torch.tensor
    assert common_prefix([t([1, 2, 3, 4]), t([1, 2, 3, 9])]) == 3
    assert common_prefix([t([1, 2, 3]), t([1, 2, 3])]) == 2  # the same twice: the last is its own
    assert common_prefix([t([1, 2, 3]), t([7, 2, 3])]) == 0
    assert common_prefix([t([1, 2, 3, 4, 5]), t([1, 2])]) == 1  # bounded by the shortest
    assert common_prefix([t([1]), t([1, 2])]) == 0
