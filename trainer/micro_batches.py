"""How a batch is split across ranks and into micro-batches (pure logic, no torch)."""

from __future__ import annotations

from collections.abc import Sequence


def assign_to_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank, balancing tokens (longest first, onto the least-loaded rank)."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(idx) for idx in out]


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that each padded micro-batch (count x longest) fits the budget.

    Sorting by length keeps padding small. A sample longer than the budget gets a micro-batch
    of its own rather than being truncated.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
