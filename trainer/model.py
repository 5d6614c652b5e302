"""Loading the policy and running it on packed micro-batches.

The loss code works on right-padded [B, T] tensors; the forward pass does not: a micro-batch's
samples are concatenated into one row with positions restarting at 0 per sample, from which
transformers builds a block-diagonal causal mask (no sample attends to another, and no compute
is spent on padding), and the logits are laid back out as [B, T, V].
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, PreTrainedModel


def load_policy(model_dir: Path, device: torch.device) -> PreTrainedModel:
    """The HF model in fp32 (master weights; mixed precision is FSDP2's job on GPU)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False  # training never reuses a KV cache
    return model.to(device)


def pad_batch(
    rows: Sequence[Sequence[float]] | Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Right-pad ragged rows with zeros into one [B, T] tensor."""
    width = max(len(r) for r in rows)
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
    return out.to(device)


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """Logits [B, T, V] of a right-padded batch, computed packed; padding positions are 0."""
    device = input_ids.device
    rows = [input_ids[i, :n] for i, n in enumerate(lengths)]
    packed = torch.cat(rows)[None, :]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None, :]
    # No attention_mask: with packed position ids transformers masks per sample by itself.
    logits = model(input_ids=packed, position_ids=positions).logits[0]
    per_sample = torch.split(logits, list(lengths))
    out = pad_sequence(list(per_sample), batch_first=True)
    if out.shape[1] < input_ids.shape[1]:  # rows padded wider than the longest sample
        out = torch.nn.functional.pad(out, (0, 0, 0, input_ids.shape[1] - out.shape[1]))
    return out
