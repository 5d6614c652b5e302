"""Does the toy example learn as well fully async as synchronously?

Trains examples/toy (the main job's config) with η = 0 (synchronous, on-policy) and with
η = --eta (fully async; the max-off-policy bound follows η) for the same number of steps,
under several seeds, and compares the final rewards: the mean batch reward of the last
--final-steps steps of each run, against the spread between seeds of the same mode (the
noise a single run carries). Every run starts its own replicas and gateway, as
`lockgate train` does, so the modes see the same conditions.

Writes OUT/<mode>-seed<S>/ (each a normal run dir), OUT/results.json, OUT/report/ (the reward
curves of every run in one `lockgate report` page) and a Markdown table on stdout. Run from
the repository root:

    PYTHONPATH=. .venv/bin/python benchmarks/async_learning.py --out runs/bench-async-learning
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from lockgate.coordinator.config import load_config
from lockgate.coordinator.launch.local import train
from lockgate.coordinator.metrics.report import write_report
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import Reward, Staleness, read_metrics

TOY = Path(__file__).resolve().parent.parent / "examples" / "toy" / "config.yaml"


def run_one(args: argparse.Namespace, mode: str, eta: int, seed: int) -> dict[str, Any]:
    run_dir = args.out / f"{mode}-seed{seed}"
    config = load_config(
        TOY,
        [
            f"name={mode}-seed{seed}",
            f"seed={seed}",
            f"loop.steps={args.steps}",
            f"loop.max_staleness={eta}",
        ],
    )
    config.run_dir = run_dir
    summary = train(config)
    records = read_metrics(RunDir(run_dir).metrics)
    rewards = [float(r[Reward.MEAN]) for r in records]
    tail = rewards[-args.final_steps :]
    return {
        "mode": mode,
        "eta": eta,
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_s": summary.elapsed_s,
        "first_reward": statistics.fmean(rewards[: args.final_steps]),
        "final_reward": statistics.fmean(tail),
        # The step-to-step noise of that mean (batch rewards are noisy samples of the policy).
        "final_reward_sem": statistics.stdev(tail) / math.sqrt(len(tail)) if len(tail) > 1 else 0.0,
        "staleness_mean": statistics.fmean(float(r[Staleness.MEAN]) for r in records),
        "validation": [
            (int(r["val/version"]), float(r["val/reward_mean"]))
            for r in records
            if "val/version" in r
        ],
    }


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the mean final reward over seeds and its spread; the gap between the modes.

    "Within noise" means the gap is no larger than twice the standard error of the gap,
    taken from the seed-to-seed spread of both modes (or, with one seed each, from the runs'
    own step-to-step noise).
    """
    modes: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        finals = [r["final_reward"] for r in results if r["mode"] == mode]
        if len(finals) > 1:
            sem = statistics.stdev(finals) / math.sqrt(len(finals))
        else:
            sem = next(r["final_reward_sem"] for r in results if r["mode"] == mode)
        modes[mode] = {"final_mean": statistics.fmean(finals), "final_sem": sem, "runs": finals}
    a, b = list(modes.values())[:2]
    gap = b["final_mean"] - a["final_mean"]
    gap_sem = math.hypot(a["final_sem"], b["final_sem"])
    return {
        "modes": modes,
        "gap": gap,
        "gap_sem": gap_sem,
        "within_noise": abs(gap) <= 2 * gap_sem,
    }


def table(results: list[dict[str, Any]], comparison: dict[str, Any], final_steps: int) -> str:
    lines = [
        f"| run | η | first {final_steps} steps | last {final_steps} steps (± s.e.) "
        "| greedy validation (version: reward) | staleness mean | wall-clock |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        val = ", ".join(f"{v}: {x:.3f}" for v, x in r["validation"])
        lines.append(
            f"| {r['mode']}-seed{r['seed']} | {r['eta']} | {r['first_reward']:.3f} "
            f"| {r['final_reward']:.3f} ± {r['final_reward_sem']:.3f} | {val} "
            f"| {r['staleness_mean']:.2f} | {r['wall_s']:.0f} s |"
        )
    lines.append("")
    for mode, m in comparison["modes"].items():
        runs = ", ".join(f"{x:.3f}" for x in m["runs"])
        lines.append(
            f"- {mode}: final reward {m['final_mean']:.3f} ± {m['final_sem']:.3f} (runs: {runs})"
        )
    verdict = "within" if comparison["within_noise"] else "NOT within"
    lines.append(
        f"- gap {comparison['gap']:+.3f} ± {comparison['gap_sem']:.3f}: {verdict} noise "
        "(|gap| <= 2 s.e.)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async-learning"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eta", type=int, default=2, help="η of the async runs")
    parser.add_argument(
        "--seeds", default="0,1", help="comma-separated seeds, one run per mode each"
    )
    parser.add_argument(
        "--final-steps", type=int, default=5, help="steps averaged for the final reward"
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.eta < 1 or not seeds or args.final_steps < 1 or args.final_steps > args.steps:
        parser.error("need --eta >= 1, at least one seed and 1 <= --final-steps <= --steps")

    results: list[dict[str, Any]] = []
    for seed in seeds:  # modes alternate so a slow spell of the machine hits both
        for mode, eta in (("sync", 0), (f"async-eta{args.eta}", args.eta)):
            results.append(run_one(args, mode, eta, seed))
            print(f"{mode} seed {seed}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    comparison = compare(results)
    report = write_report([Path(r["run_dir"]) for r in results], args.out / "report")
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "settings": {k: str(v) for k, v in vars(args).items()},
                "results": results,
                "comparison": comparison,
                "report": str(report.html),
            },
            indent=2,
        )
    )
    print(table(results, comparison, args.final_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
