"""The scale simulation (benchmarks/scale_simulation.py): its metrics, the routing policy in virtual
time, the pause gate (the whole run small: tests/integration/test_scale_simulation.py)."""

from __future__ import annotations

import asyncio
import math

import pytest
import uvloop

from benchmarks.routing_policy_sim import PolicyResult, simulate_policy
from benchmarks.scale_simulation import (
    calls_per_replica,
    imbalance,
    pause_spreads,
    stickiness,
    tokens_per_replica,
)
from benchmarks.sim_replicas import BLOCK, PauseRecord, RequestRecord, block_hashes
from lockgate.gateway.replicas.pause import PauseGate


def _rec(
    replica: int, key: int, t: float, prompt: int, cached: int, tokens: int = 10
) -> RequestRecord:
    return RequestRecord(replica, key, t, prompt, cached, tokens, "stop")


def test_imbalance_is_the_busiest_share_over_the_mean() -> None:
    assert imbalance([10, 10, 10, 10]) == 0.0
    assert imbalance([15, 5]) == pytest.approx(0.5)  # mean 10, max 15
    assert imbalance([0, 0]) == 0.0
    assert math.isnan(imbalance([]))


def test_tokens_and_calls_per_replica() -> None:
    records = [_rec(0, 1, 0.0, 32, 0, 5), _rec(1, 2, 0.1, 32, 0, 7), _rec(0, 1, 0.2, 64, 32, 3)]
    assert tokens_per_replica(records, 3) == [8, 7, 0]
    assert calls_per_replica(records, 3) == [2, 1, 0]


def test_stickiness_follows_each_session_in_arrival_order() -> None:
    records = [
        # session 1: first on replica 0, back to 0 with its prefix cached, then moved to 1
        _rec(0, 1, 0.0, 40, 0),
        _rec(0, 1, 1.0, 90, 32),  # 40 // 16 * 16 = 32 cached: a hit
        _rec(1, 1, 2.0, 150, 0),  # another replica: neither sticky nor a hit
        # session 2, listed out of order: back on its replica, but the cache lost its prefix
        _rec(2, 2, 1.5, 70, 16),
        _rec(2, 2, 0.5, 33, 0),
    ]
    s = stickiness(records)
    assert (s.followups, s.sticky, s.prefix_hits) == (3, 2, 1)
    assert s.sticky_rate == pytest.approx(2 / 3)
    assert s.prefix_hit_rate == pytest.approx(1 / 3)
    assert math.isnan(stickiness([]).sticky_rate)


def test_pause_spread_runs_from_first_arrival_to_last_answer() -> None:
    pauses = [
        PauseRecord(0, 1.00, 1.02, 3),
        PauseRecord(1, 1.01, 1.05, 0),
        PauseRecord(0, 5.00, 5.01, 1),
        PauseRecord(1, 5.03, 5.04, 2),
    ]
    assert pause_spreads(pauses, 2) == pytest.approx([0.05, 0.04])
    assert pause_spreads(pauses, 3) == []  # a replica never paused: no complete fan-out


def test_block_hashes_chain_over_whole_blocks() -> None:
    ids = list(range(40))
    hashes = block_hashes(ids)
    assert len(hashes) == 40 // BLOCK
    assert block_hashes(ids[:BLOCK]) == hashes[:1]
    # A block's hash covers everything before it: the same block after another start differs.
    assert block_hashes([99, *ids[1:]])[1] != hashes[1]


def test_routing_policy_keeps_sessions_home_and_load_even() -> None:
    # The gateway's own pool and policy in virtual time: 16 replicas, 400 agents, 2 minutes.
    def run(max_ratio: float) -> PolicyResult:
        return simulate_policy(
            replicas=16,
            sessions=400,
            turns=6,
            think_s=3.0,
            duration_s=120.0,
            max_ratio=max_ratio,
            seed=1,
        )

    shipped, before = run(2.0), run(0.0)
    assert shipped.calls > 5000 and shipped.followups > 4000
    assert shipped.sticky_rate > 0.97
    assert shipped.sticky_rate > before.sticky_rate
    assert shipped.imbalance < 0.10


def test_resuming_wakes_every_waiting_call_at_once() -> None:
    # At scale hundreds of calls wait at the gate during a sync; they must all be admitted
    # within a few loop iterations of the resume, not one by one (and a pause right after the
    # resume must not queue behind them).
    async def run() -> int:
        gate = PauseGate()
        await gate.set_state("paused")
        tasks = [asyncio.create_task(gate.admit()) for _ in range(500)]
        await asyncio.sleep(0)
        assert gate.waiting == 500
        passes = 0
        await gate.set_state("serving")
        while not all(t.done() for t in tasks):
            passes += 1
            await asyncio.sleep(0)
        assert gate.in_flight == 500 and gate.waiting == 0
        return passes

    assert uvloop.run(run()) <= 5
