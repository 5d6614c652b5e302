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
    """Group sample indices into micro-batches of at most `token_budget` tokens in total.

    Micro-batches are not padded (`model.forward_logits` packs their samples into one row on
    CUDA, runs them one at a time on CPU), so what counts is the sum of the lengths, not count x
    longest. First-fit over the samples
    from the longest down fills the micro-batches tightly. A sample longer than the budget gets
    a micro-batch of its own rather than being truncated.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                batches[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            batches.append([i])
            loads.append(lengths[i])
    return batches
