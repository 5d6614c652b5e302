"""The trainer's logprobs of token sequences, the same definition the loss uses.

`logprobs_from_dir` runs without any process group: it is how tests and tools check that what
the replicas recorded is what the trainer computes (logprob parity). Given a LoRA adapter dir
it runs the adapter's base model with the adapter applied, as the trainer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from lockgate.trainer.lora import is_adapter_dir, is_lora_name, read_adapter
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
    return sequence_logprobs(load_from_dir(Path(model_dir), device), sequences, device)


def load_from_dir(path: Path, device: torch.device) -> torch.nn.Module:
    """The model in an HF model dir, or in an adapter dir its base with the adapter applied
    (eval mode)."""
    if not is_adapter_dir(path):
        return load_policy(path, device).eval()
    spec, base, tensors = read_adapter(path)
    model = load_policy(base, device, spec)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    adapters = [name for name in missing if is_lora_name(name)]
    if adapters or unexpected:
        raise ValueError(
            f"{path} does not fit {base}: missing {adapters[:3]}, unexpected {unexpected[:3]}"
        )
    return model.eval()
