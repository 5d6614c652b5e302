"""The trainer's logprobs of token sequences, the same definition the loss uses.

`logprobs_from_dir` runs without any process group: it is how tests and tools check that what
the replicas recorded is what the trainer computes (logprob parity).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from lockgate.trainer.loss import token_logprobs
from lockgate.trainer.micro_batches import plan_micro_batches
from lockgate.trainer.model import forward_logits, load_policy, pad_batch


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    device: torch.device,
    token_budget: int = 4096,
) -> list[list[float]]:
    """out[i][t] = log p(seq_i[t] | seq_i[:t]); out[i][0] = 0.0."""
    out: list[list[float]] = [[] for _ in sequences]
    lengths = [len(s) for s in sequences]
    for idx in plan_micro_batches(lengths, token_budget):
        ids = pad_batch([sequences[i] for i in idx], torch.long, device)
        lens = [lengths[i] for i in idx]
        lp = token_logprobs(forward_logits(model, ids, lens), ids).cpu()
        for row, i in enumerate(idx):
            out[i] = lp[row, : lengths[i]].tolist()
    return out


def logprobs_from_dir(model_dir: Path, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    device = torch.device("cpu")
    model = load_policy(Path(model_dir), device).eval()
    return sequence_logprobs(model, sequences, device)
