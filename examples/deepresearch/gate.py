"""The SFT gate of the CPU recipe: the warm start must answer, and search 2-hop questions
twice, before RL starts from it.

    python -m lockgate.examples.deepresearch.gate --sft-out RUN/sft --kb-dir DATA/val_kb \
        --work RUN/gate [--threshold 0.10 --min-two-hop-searches 1.8 --extra-chunks 2 \
        --chunk-steps 250] [-- EVALUATE_ARGS]

evaluates `RUN/sft/final` on the held-out questions of the validation knowledge base (a world
apart from the evaluation's, prepare.py) at temperature 1 with `evaluate.py run`, and while its
success is below the threshold, or it searches 2-hop questions fewer times than the least, it
continues the SFT run for another chunk (`lockgate sft --resume` with `chunk_steps` more
steps, into one more epoch over the same transcripts), up to `extra_chunks` times. It exits 0
once the model passes; otherwise 1, printing one line on stdout that says why, which
run_cpu.sh reports as `[deepresearch] stage 2 (SFT): <line>`.

A chunk resumes the run rather than starting another over new data because resuming is what
`lockgate sft` does today with nothing new to prepare: the same transcripts, the optimizer's
state, the learning rate where its schedule left it, and `final/` replaced in place, so every
later stage reads the same model path. The decision is `decide` (pure); the rest runs the
commands.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

Action = Literal["pass", "continue", "stop"]
MODEL = "model T=1"  # the evaluation's policy the gate reads


class GateRule(BaseModel):
    """When the SFT model may go on to RL, and how long SFT may continue until it does.

    The threshold sits between the starts RL gained from and the one it could not: whole runs
    started at 0.18-0.28 (T=1, held-out) and gained; a start at 0.003 gained nothing
    (EXPERIMENTS.md, "Warm-start gates"). 0.10 is ~3 standard errors of a 200-episode
    estimate under the weakest good start and far above the failed one.

    The second search is what RL builds on: a start that answers 2-hop questions after one
    search gives GRPO few groups where searching again wins, and RL then drops it further
    instead of teaching it (EXPERIMENTS.md, "The second search at the gate").
    """

    threshold: float = Field(
        default=0.10, ge=0, description="least success at T=1 (above 1: no model passes)"
    )
    min_two_hop_searches: float = Field(
        default=1.8,
        ge=0,
        description="least tool calls per 2-hop validation episode at T=1 (0: not checked)",
    )
    extra_chunks: int = Field(default=2, ge=0, description="SFT chunks after the first check")
    chunk_steps: int = Field(default=250, ge=1, description="SFT steps per chunk")


@dataclass(frozen=True)
class Validation:
    """What the gate reads off one validation: success and 2-hop searches, both at T=1."""

    success: float
    two_hop_searches: float


@dataclass(frozen=True)
class Verdict:
    action: Action
    line: str


def decide(measured: Validation, chunks_done: int, rule: GateRule) -> Verdict:
    """What to do with an SFT model validated at `measured` after `chunks_done` extra chunks."""
    success = f"validation success (T=1) {measured.success:.3f}"
    searches = f"2-hop questions searched {measured.two_hop_searches:.2f} times"
    answers = measured.success >= rule.threshold
    searches_again = measured.two_hop_searches >= rule.min_two_hop_searches
    if answers and searches_again:
        line = f"{success}, at or above {rule.threshold}"
        if rule.min_two_hop_searches > 0:
            line += f"; {searches}, at least {rule.min_two_hop_searches}"
        return Verdict("pass", line)
    short = (
        f"{success}, below {rule.threshold}"
        if not answers
        else f"{searches}, under {rule.min_two_hop_searches}"
    )
    if chunks_done < rule.extra_chunks:
        return Verdict(
            "continue",
            f"{short}: SFT chunk {chunks_done + 1} of {rule.extra_chunks} "
            f"({rule.chunk_steps} more steps)",
        )
    chunks = f"{chunks_done} extra chunk{'' if chunks_done == 1 else 's'}"
    cap = f"after {chunks} of {rule.chunk_steps} steps (the cap)"
    if not answers:
        return Verdict(
            "stop",
            f"the SFT model's {success} is below {rule.threshold} {cap}; "
            "the warm start does not answer",
        )
    return Verdict(
        "stop",
        f"the SFT model searched 2-hop validation questions {measured.two_hop_searches:.2f} "
        f"times, under {rule.min_two_hop_searches}, {cap}; the warm start answers them without "
        "their second search",
    )


def continued_loop(config_json: str, recorded_steps: int, chunk_steps: int) -> list[str]:
    """The `--set` overrides that continue an SFT run (its resolved config) for `chunk_steps`
    more steps than the `recorded_steps` it has run, within one more epoch."""
    loop = json.loads(config_json)["loop"]
    return [f"loop.epochs={loop['epochs'] + 1}", f"loop.max_steps={recorded_steps + chunk_steps}"]


class StageFailed(Exception):
    """A command the gate runs failed (its own output says how)."""


def _run(command: list[str], what: str) -> None:
    # The gate's stdout carries only its verdict line: the commands print to stderr.
    code = subprocess.run(command, stdout=2).returncode
    if code != 0:
        raise StageFailed(f"{what} failed (exit code {code})")


def _recorded_steps(sft_out: Path) -> int:
    lines = (sft_out / "metrics.jsonl").read_text().splitlines()
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _validate(model: Path, kb_dir: Path, out: Path, evaluate_args: list[str]) -> Validation:
    """The model at T=1 on `kb_dir`'s held-out questions (`evaluate.py run`)."""
    command = [sys.executable, "-m", "lockgate.examples.deepresearch.evaluate", "run"]
    command += ["--model", str(model), "--kb-dir", str(kb_dir), "--out", str(out)]
    command += ["--temperatures", "1.0", *evaluate_args]
    _run(command, "the validation (evaluate.py run)")
    summary = next(s for s in json.loads(out.read_text())["summaries"] if s["name"] == MODEL)
    success = float(summary["success"])
    # No 2-hop question among them (a toy validation set) reads as no second search.
    searches = float(summary["tool_calls_by_hops"].get("2", 0.0))
    return Validation(0.0 if math.isnan(success) else success, searches)


def _continue_sft(sft_out: Path, steps: int) -> None:
    config = sft_out / "config.json"
    sets = continued_loop(config.read_text(), _recorded_steps(sft_out), steps)
    command = [sys.executable, "-m", "lockgate.coordinator.cli", "sft", str(config), "--resume"]
    _run([*command, *(a for s in sets for a in ("--set", s))], "lockgate sft --resume")


def run_gate(
    sft_out: Path, kb_dir: Path, work: Path, rule: GateRule, evaluate_args: list[str]
) -> Verdict:
    """Validate, continue SFT while the rule says so; the last verdict."""
    work.mkdir(parents=True, exist_ok=True)
    chunks = 0
    while True:
        measured = _validate(sft_out / "final", kb_dir, work / f"val_{chunks}.json", evaluate_args)
        verdict = decide(measured, chunks, rule)
        print(f"[gate] {verdict.line}", file=sys.stderr, flush=True)
        if verdict.action != "continue":
            return verdict
        _continue_sft(sft_out, rule.chunk_steps)
        chunks += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lockgate.examples.deepresearch.gate",
        description="Validate the SFT model on the validation knowledge base; continue SFT "
        "within a cap until it passes. Arguments after -- go to `evaluate.py run`.",
    )
    parser.add_argument("--sft-out", type=Path, required=True, help="the SFT run's out_dir")
    parser.add_argument("--kb-dir", type=Path, required=True, help="the validation KB")
    parser.add_argument("--work", type=Path, required=True, help="where the evaluations go")
    defaults = GateRule()
    parser.add_argument("--threshold", type=float, default=defaults.threshold)
    parser.add_argument("--min-two-hop-searches", type=float, default=defaults.min_two_hop_searches)
    parser.add_argument("--extra-chunks", type=int, default=defaults.extra_chunks)
    parser.add_argument("--chunk-steps", type=int, default=defaults.chunk_steps)
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    rule = GateRule(
        threshold=args.threshold,
        min_two_hop_searches=args.min_two_hop_searches,
        extra_chunks=args.extra_chunks,
        chunk_steps=args.chunk_steps,
    )
    try:
        verdict = run_gate(args.sft_out, args.kb_dir, args.work, rule, argv[split + 1 :])
    except StageFailed as exc:
        print(exc)
        return 1
    if verdict.action == "stop":
        print(verdict.line)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
