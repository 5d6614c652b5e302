"""Group-relative advantages (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def grpo_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps), or unnormalised (Dr. GRPO style) if asked.

    std is the population standard deviation of the group.
    """
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]
