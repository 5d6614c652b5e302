"""Loading the policy and running it on micro-batches without padding.

The loss code works on right-padded [B, T] tensors; the forward pass does not pad. On CUDA, and
with several ranks, a micro-batch's samples are concatenated into one row with positions
restarting at 0 per sample, and attention runs per sample within the row (attention.py:
FlashAttention's varlen kernel on CUDA, causal SDPA per sample on the CPU): one forward pass
per micro-batch. On one CPU rank each sample runs alone instead, which lets the samples share
their common prefix (below); for a small model on one thread, one sample at a time was faster
than packed rows or padded batches (measured in docs/performance.md, "Trainer").
`micro_batch_packing` in the trainer's config picks either way.
Either way the logits are laid back out as [B, T, V].

One sample at a time, the tokens that every sample of the micro-batch starts with (the system
prompt and tool schemas of an agent's rollouts, often half of each sample) run once: their
keys and values are kept, and each sample runs only the rest of its tokens against them. The logits and gradients are those of running each sample whole (equal to
float rounding: tests/unit/trainer/test_trainer_packing.py), and the shared prefix's work is done once per
micro-batch instead of once per sample (measured in docs/performance.md, "Trainer").
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from lockgate.trainer import attention
from lockgate.trainer.config import LoraSpec
from lockgate.trainer.lora import apply_lora


def load_policy(
    model_dir: Path, device: torch.device, lora: LoraSpec | None = None
) -> PreTrainedModel:
    """The HF model in fp32 (master weights; mixed precision is FSDP2's job on GPU); with
    `lora`, adapters on its target layers and only they trainable (trainer/lora.py)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=attention.IMPLEMENTATION
    )
    model.config.use_cache = False  # training never reuses a KV cache
    if lora is not None:
        apply_lora(model, lora)
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
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    lengths: Sequence[int],
    *,
    pack: bool | None = None,
) -> torch.Tensor:
    """Logits [B, T, V] of a right-padded batch, computed unpadded; padding positions are 0.

    `pack` (default: on CUDA, or with several ranks) runs the samples as one packed row, else
    one at a time. Sharded over several ranks, each forward pass all-gathers the parameters, and
    the ranks' micro-batches hold different numbers of samples: one packed pass per micro-batch
    keeps every rank's collectives in step.
    """
    device = input_ids.device
    rows = [input_ids[i, :n] for i, n in enumerate(lengths)]
    if pack is None:
        pack = device.type == "cuda" or _ranks() > 1
    if not pack:
        shared = common_prefix(rows)
        if len(rows) > 1 and shared >= MIN_SHARED_PREFIX and not _has_sliding_window(model):
            per_sample = _after_shared_prefix(model, rows, shared)
        else:
            per_sample = [model(input_ids=row[None, :]).logits[0] for row in rows]
        return _pad_to(pad_sequence(per_sample, batch_first=True), input_ids.shape[1])
    packed = torch.cat(rows)[None, :]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None, :]
    starts = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)
    # The samples' bounds take attention.packed_attention's per-sample path (any other
    # attention implementation masks per sample by itself, from the restarting positions).
    logits = model(
        input_ids=packed,
        position_ids=positions,
        cu_seq_lens_q=starts,
        cu_seq_lens_k=starts,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
    ).logits[0]
    return _pad_to(
        pad_sequence(list(torch.split(logits, list(lengths))), batch_first=True), input_ids.shape[1]
    )


# Below this many tokens in common, running the prefix apart saves less than it costs.
MIN_SHARED_PREFIX = 32


def common_prefix(rows: Sequence[torch.Tensor]) -> int:
    """How many leading tokens every row has in common, leaving each at least one of its own."""
    shortest = min(len(r) for r in rows)
    if shortest < 2:
        return 0
    first = rows[0][: shortest - 1]
    same = torch.ones_like(first, dtype=torch.bool)
    for row in rows[1:]:
        same &= row[: shortest - 1] == first
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else len(first)


def _after_shared_prefix(
    model: torch.nn.Module, rows: Sequence[torch.Tensor], shared: int
) -> list[torch.Tensor]:
    """Each row's logits, its first `shared` tokens (the same in every row) run once."""
    head = model(input_ids=rows[0][None, :shared], use_cache=True)
    cache = _PrefixCache(head.past_key_values)
    out = []
    for row in rows:
        positions = torch.arange(shared, len(row), device=row.device)[None, :]
        tail = model(
            input_ids=row[None, shared:],
            past_key_values=cache,
            position_ids=positions,
            use_cache=True,
        )
        out.append(torch.cat([head.logits[0], tail.logits[0]]))
    return out


class _PrefixCache(DynamicCache):
    """The shared prefix's keys and values, which a forward reads and never appends to: every
    row's tail attends to the same prefix, and a layer recomputed in backward (activation
    checkpointing) sees the cache exactly as its first pass did."""

    def __init__(self, prefix: DynamicCache) -> None:
        super().__init__()
        for i, layer in enumerate(prefix.layers):
            super().update(layer.keys, layer.values, i)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        return (
            torch.cat([layer.keys, key_states], dim=-2),
            torch.cat([layer.values, value_states], dim=-2),
        )


def _has_sliding_window(model: torch.nn.Module) -> bool:
    """A sliding-window layer's KV cache keeps only the window's keys, so rows cannot attend
    to a shared prefix through it: such a model runs each row whole."""
    config = getattr(model, "config", None)
    return getattr(config, "sliding_window", None) is not None and "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    )


def _ranks() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _pad_to(logits: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T, V] logits zero-padded to `width` positions (rows padded wider than the longest)."""
    if logits.shape[1] < width:
        logits = torch.nn.functional.pad(logits, (0, 0, 0, width - logits.shape[1]))
    return logits
