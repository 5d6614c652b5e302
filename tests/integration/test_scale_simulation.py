"""The scale simulation (benchmarks/scale_simulation.py), the whole run small.

The small run is the real thing at a tenth of a second's scale: the real gateway as a process,
4 stand-in replicas, 40 agent sessions, a few pauses. With no replica leaving, every follow-up
call must go back to its session's replica and find its prefix cached, and every session that
started must end with all its turns answered.
"""

from __future__ import annotations

from pathlib import Path

import uvloop

from benchmarks.scale_simulation import (
    SimConfig,
    simulate,
)


def test_small_simulation_end_to_end(tmp_path: Path) -> None:
    cfg = SimConfig(
        replicas=4,
        sessions=40,
        turns=3,
        duration_s=3.0,
        ramp_s=0.5,
        think_s=0.3,
        pauses=3,
        pause_hold_s=0.05,
        status_every_s=2.0,
        pin=False,
    )
    r = uvloop.run(simulate(cfg, tmp_path))
    c = r.counters
    assert c.errors == 0, c.first_error
    assert c.sessions_finished == c.sessions_started >= cfg.sessions
    assert c.turns_per_session_ok and c.turns == c.sessions_finished * cfg.turns
    assert r.tokens_generated > 0 and len(r.tokens_per_replica) == 4
    assert all(t > 0 for t in r.tokens_per_replica)
    assert 0.0 <= r.routing_imbalance_tokens < 1.0
    # No replica paused for good or left: every follow-up call goes home and hits its prefix.
    assert r.sticky.followups > 0
    assert r.sticky_rate == 1.0
    assert r.prefix_hit_rate == 1.0
    assert r.pause_replicas_paused_s["n"] == 3
    assert r.pause_fanout_at_replicas_s["n"] == 3
    assert 0.0 < r.pause_replicas_paused_s["p99"] < 5.0
    assert r.gateway_cpu_s > 0.0
