"""What a finished run recorded, read back for parity checks: its calls from the SQLite store,
each sampled token under the weights version that sampled it, and the trainer's logprobs for
them."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections import defaultdict
from pathlib import Path

import torch

from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.schema import CallRecord
from lockgate.gateway.store.trajectories import TrajectoryStore
from lockgate.trainer.logprobs import sequence_logprobs

# (sequence up to and with the token, its position, the recorded logprob)
Token = tuple[list[int], int, float]


def run_calls(
    run_dir: Path, since: float = 0.0, store_path: Path | None = None
) -> list[CallRecord]:
    """Every call of the run's sessions (of its training store unless `store_path` says)
    created at or after `since` (unix time)."""
    path = store_path or RunDir(run_dir).store
    with contextlib.closing(sqlite3.connect(path)) as db:
        ids = [r[0] for r in db.execute("SELECT id FROM sessions WHERE created_at >= ?", (since,))]
    store = TrajectoryStore(path)

    async def read() -> list[CallRecord]:
        return [call for sid in ids for call in await store.get_calls(sid)]

    try:
        return asyncio.run(read())
    finally:
        store.close()


def tokens_by_version(calls: list[CallRecord]) -> dict[int, list[Token]]:
    """version -> every token sampled under it."""
    out: dict[int, list[Token]] = defaultdict(list)
    for call in calls:
        seq = call.prompt_ids + call.completion_ids
        for span in call.versions:
            for i in range(span.start, span.end):
                out[span.version].append((seq, len(call.prompt_ids) + i, call.logprobs[i]))
    return out


def mean_abs_diff(model: torch.nn.Module, tokens: list[Token]) -> float:
    """Mean |the model's logprob - the recorded one| over `tokens`."""
    seqs = {tuple(seq): None for seq, _, _ in tokens}
    device = torch.device("cpu")
    computed = dict(zip(seqs, sequence_logprobs(model, [list(s) for s in seqs], device), strict=True))  # fmt: skip
    diffs = [abs(computed[tuple(seq)][pos] - lp) for seq, pos, lp in tokens]
    return sum(diffs) / len(diffs)
