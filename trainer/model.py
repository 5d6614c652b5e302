"""Loading the policy and running it on padded micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
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
    """Logits [B, T, V] of a right-padded batch; padding is masked out of attention."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    attention_mask = (
        positions[None, :] < torch.tensor(list(lengths), device=input_ids.device)[:, None]
    ).long()
    return model(input_ids=input_ids, attention_mask=attention_mask).logits  # type: ignore[no-any-return]
