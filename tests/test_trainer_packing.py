"""Micro-batches: packed (CUDA's way) or one sample at a time (CPU's), the same logits as running
each sample alone, no attention across samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockgate.trainer.model import forward_logits, load_policy, pad_batch


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
