"""Held-out exact match for `lockgate sft`: whether a conversation's every trained token is the
model's argmax given the true tokens before it.

Under teacher forcing the prefix before each assistant token is the target's own, so a
conversation that matches here is one greedy decoding would write token for token (each
assistant turn from its true prompt); it is read off the validation forward pass, at no
generation cost.
"""

from __future__ import annotations

import torch


def exact_rows(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Per row of a right-padded batch (logits [B, T, V], ids and mask [B, T], mask 1 on the
    trained tokens): True when every trained token t is the argmax of logits[t - 1]. A row
    with no trained token is True (nothing to get wrong); callers count only rows that have
    one."""
    predicted = logits[:, :-1].argmax(dim=-1)
    wrong = (predicted != input_ids[:, 1:]) & (loss_mask[:, 1:] > 0)
    return ~wrong.any(dim=1)
