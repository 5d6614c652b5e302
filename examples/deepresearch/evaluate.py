"""Held-out evaluation: success of a model (at temperature 1 and greedy) and of the baselines.

    python -m lockgate.examples.deepresearch.evaluate run --model DIR --out eval.json
    python -m lockgate.examples.deepresearch.evaluate compare before.json after.json
    python -m lockgate.examples.deepresearch.evaluate merge pooled.json a.json b.json

`run` evaluates on a knowledge base's held-out questions: the recipe's (`--kb-dir`), or one built
with a seed the recipe never used (`--kb-seed N`: a new held-out world, its questions and its
documents, among new training worlds; the report records the seed). It starts a retrieval
service on the knowledge base, local vLLM replicas of the model (or
uses running ones: `--replica-urls`, `--expect-weight-version`) and a lockgate gateway that
honours each call's temperature, then runs the agent once per held-out question per temperature,
plus two baselines on the same questions: the scripted oracle (search the entity, read, answer:
the ceiling retrieval leaves) and the model with a search tool that finds nothing (what it
answers from memory: near 0 on unseen entities). Success is exact match after SQuAD
normalisation; F1 (the training reward) is reported beside it, and both are split by hops.
`compare` prints the lines the CPU recipe ends with; `merge` pools two runs of one model (more
episodes per question, a smaller sampling error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from tqdm import tqdm

from lockgate.agent_runtime import RolloutContext, Task, run_rollout
from lockgate.agent_runtime.connections import close_shared_transport
from lockgate.coordinator.run_dir import RunDir
from lockgate.examples.deepresearch.agent import AgentConfig, Tools
from lockgate.examples.deepresearch.data import (
    HELDOUT,
    MANIFEST,
    KBSpec,
    build_cpu_kb,
    kb_seed,
    load_questions,
    validation_kb_seed,
)
from lockgate.examples.deepresearch.env import question_task, task_episode
from lockgate.examples.deepresearch.oracle import run_oracle
from lockgate.examples.deepresearch.questions import Question
from lockgate.examples.deepresearch.retrieval.client import Hit, RetrievalClient
from lockgate.examples.deepresearch.reward import exact_match, f1_score
from lockgate.gateway.client import GatewayClient


class Outcome(BaseModel):
    question_id: str
    hops: int
    em: float
    f1: float
    ended: str
    tool_calls: int = 0


class Summary(BaseModel):
    name: str
    n: int
    success: float
    success_se: float
    f1: float
    by_hops: dict[str, float]
    ended: dict[str, int]
    # Mean tool calls per episode by hop count: RL that helps 1-hop questions by answering
    # after one search shows here as 2-hop questions searched once (EXPERIMENTS.md).
    tool_calls_by_hops: dict[str, float] = {}

    def line(self) -> str:
        hops = ", ".join(f"{h}-hop {v:.3f}" for h, v in sorted(self.by_hops.items()))
        return (
            f"{self.name:<16} success {self.success:.3f} ± {self.success_se:.3f} "
            f"(n={self.n}; {hops}), F1 {self.f1:.3f}"
        )


def summarize(name: str, outcomes: Sequence[Outcome]) -> Summary:
    """Success over every episode; its standard error over questions (several episodes of one
    question are not independent), `n` the number of questions."""
    per_question: dict[str, list[float]] = {}
    for o in outcomes:
        per_question.setdefault(o.question_id, []).append(o.em)
    means = [sum(v) / len(v) for v in per_question.values()]
    n = len(means)
    mean = sum(o.em for o in outcomes) / len(outcomes) if outcomes else math.nan
    var = sum((m - mean) ** 2 for m in means) / (n - 1) if n > 1 else math.nan
    se = math.sqrt(var / n) if n > 1 else math.nan
    by_hops: dict[str, list[float]] = {}
    calls: dict[str, list[int]] = {}
    ended: dict[str, int] = {}
    for o in outcomes:
        by_hops.setdefault(str(o.hops), []).append(o.em)
        calls.setdefault(str(o.hops), []).append(o.tool_calls)
        ended[o.ended] = ended.get(o.ended, 0) + 1
    return Summary(
        name=name,
        n=n,
        success=mean,
        success_se=se,
        f1=sum(o.f1 for o in outcomes) / len(outcomes) if outcomes else math.nan,
        by_hops={h: sum(v) / len(v) for h, v in by_hops.items()},
        ended=ended,
        tool_calls_by_hops={h: sum(v) / len(v) for h, v in calls.items()},
    )


class NoSearch(Tools):
    """The search tool of the no-search baseline: it never finds anything."""

    async def run(self, name: str, arguments: str) -> tuple[str, str | None]:
        return "No results.", None


@dataclass(frozen=True)
class PolicyRun:
    """One policy to evaluate: the agent's settings and tools, and episodes per question."""

    name: str
    config: AgentConfig
    tools: Tools
    samples: int = 1


async def model_outcomes(
    gateway: GatewayClient,
    questions: Sequence[Question],
    runs: Sequence[PolicyRun],
    *,
    concurrency: int,
) -> dict[str, list[Outcome]]:
    """Each run's `samples` episodes per question through the gateway, at most `concurrency`
    at a time. The runs share one queue: drained one after another, each run's last episodes
    left the replicas half idle (greedy's 200 episodes ran at 15 a second, T=1's at 18)."""
    by_id = {q.id: q for q in questions}
    outcomes: dict[str, list[Outcome]] = {run.name: [] for run in runs}
    queue = [
        (run, question_task(q), k)
        for run in reversed(runs)
        for k in reversed(range(run.samples))
        for q in reversed(questions)
    ]

    def agent_of(run: PolicyRun) -> Callable[[Task, RolloutContext], Awaitable[float]]:
        async def agent(task: Task, ctx: RolloutContext) -> float:
            episode = await task_episode(task, ctx, run.tools, run.config)
            q = by_id[task.id]
            outcomes[run.name].append(
                Outcome(
                    question_id=q.id,
                    hops=q.hops,
                    em=episode.score.em,
                    f1=episode.score.f1,
                    ended=episode.ended,
                    tool_calls=len(episode.tool_calls),
                )
            )
            return episode.score.reward

        return agent

    agents = {run.name: agent_of(run) for run in runs}
    # 2,000 episodes take minutes on 2 cores: say how far it is (a line every 15 s in a log).
    progress = tqdm(total=len(queue), desc="episodes", unit="ep", file=sys.stderr, mininterval=15)

    async def worker() -> None:
        while queue:
            run, task, k = queue.pop()
            label = run.name.replace(" ", "-")
            result = await run_rollout(
                gateway, agents[run.name], task, group_id=f"{label}-{task.id}-{k}", timeout_s=300.0
            )
            if result.status == "failed":
                q = by_id[task.id]
                outcomes[run.name].append(
                    Outcome(question_id=q.id, hops=q.hops, em=0.0, f1=0.0, ended="failed")
                )
            progress.update()

    with progress:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(concurrency, len(queue))):
                tg.create_task(worker())
    return outcomes


async def oracle_outcomes(
    questions: Sequence[Question], retrieval: RetrievalClient, config: AgentConfig
) -> list[Outcome]:
    async def search(query: str, k: int) -> list[Hit]:
        return await retrieval.search(query, k)

    outcomes = []
    for q in questions:
        run = await run_oracle(q, search, config)
        answer = run.answer or ""
        outcomes.append(
            Outcome(
                question_id=q.id,
                hops=q.hops,
                em=exact_match(answer, q.golden_answers) if run.answer else 0.0,
                f1=f1_score(answer, q.golden_answers) if run.answer else 0.0,
                ended=run.failure or "answered",
                tool_calls=run.searches,
            )
        )
    return outcomes


class Report(BaseModel):
    model: str
    questions: str
    # The seed of the CPU knowledge base the questions came from (None: other questions).
    kb_seed: int | None = None
    elapsed_s: float
    # The replicas' weight version when they were given running (--replica-urls): after the
    # RL run, the version of its last step.
    weights_version: int | None = None
    summaries: list[Summary]
    outcomes: dict[str, list[Outcome]]

    def summary(self, name: str) -> Summary | None:
        return next((s for s in self.summaries if s.name == name), None)


def merge_reports(reports: Sequence[Report]) -> Report:
    """Evaluations of one model on one question set pooled into one: each policy's episodes
    together, summaries recomputed. Two runs of k episodes per question pooled halve the
    variance the sampling adds, which two runs of four showed to be several points."""
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]

    def run_of(r: Report) -> tuple[Path, Path]:  # one run may name a path relatively
        return Path(r.model).resolve(), Path(r.questions).resolve()

    for r in reports[1:]:
        if run_of(r) != run_of(first):
            raise ValueError(
                f"cannot pool evaluations of different runs: {r.model} on {r.questions} "
                f"against {first.model} on {first.questions}"
            )
    outcomes: dict[str, list[Outcome]] = {}
    for r in reports:
        for name, episodes in r.outcomes.items():
            outcomes.setdefault(name, []).extend(episodes)
    return Report(
        model=first.model,
        questions=first.questions,
        elapsed_s=sum(r.elapsed_s for r in reports),
        summaries=[summarize(name, o) for name, o in outcomes.items()],
        outcomes=outcomes,
    )


async def evaluate(
    args: argparse.Namespace, gateway_url: str, token: str, retrieval_url: str
) -> Report:
    questions = load_questions(args.questions, args.n)
    started = time.monotonic()
    outcomes: dict[str, list[Outcome]] = {}
    async with (
        GatewayClient(gateway_url, token) as gateway,
        RetrievalClient(retrieval_url) as retrieval,
    ):
        base = AgentConfig.model_validate(json.loads(args.agent))
        if args.oracle:
            outcomes["oracle"] = await oracle_outcomes(questions, retrieval, base)

        def policy(name: str, temperature: float, tools: type[Tools]) -> PolicyRun:
            config = base.model_copy(update={"temperature": temperature})
            # Made-up entities leave the no-search baseline at 0 whatever it samples: one
            # episode per question shows it (eight took 100 s of the recipe).
            sampled = temperature > 0 and tools is Tools
            return PolicyRun(name, config, tools(retrieval, config), args.samples if sampled else 1)

        runs = [policy(f"model T={t:g}", t, Tools) for t in args.temperatures]
        if args.no_search:
            runs += [policy(f"no-search T={t:g}", t, NoSearch) for t in args.temperatures]
        outcomes |= await model_outcomes(gateway, questions, runs, concurrency=args.concurrency)
        for run in runs:
            print(summarize(run.name, outcomes[run.name]).line(), file=sys.stderr, flush=True)
        await close_shared_transport()
    return Report(
        model=str(args.model),
        questions=str(args.questions),
        elapsed_s=time.monotonic() - started,
        summaries=[summarize(name, o) for name, o in outcomes.items()],
        outcomes=outcomes,
    )


# The knowledge bases the CPU recipe builds with its default seed: the evaluation's and the
# validation gate's. `--kb-seed` is for the others.
RECIPE_KB_SEEDS = (0, validation_kb_seed(0))


def knowledge_base(kb_dir: Path | None, seed: int | None) -> Path:
    """The knowledge base to evaluate on: with `seed`, the CPU one of that seed (built in
    `kb_dir`, default a cache folder per seed, unless it is there already); without, `kb_dir`
    as it is, or the default one, built when missing. ValueError for a seed the recipe uses
    or a `kb_dir` that holds another seed's."""
    from lockgate.trainer.tiny_models.builder import default_cache_dir

    if seed is None:
        kb_dir = kb_dir or default_cache_dir() / "deepresearch-kb"
        return kb_dir if (kb_dir / MANIFEST).is_file() else build_cpu_kb(kb_dir)
    if seed in RECIPE_KB_SEEDS:
        raise ValueError(
            f"--kb-seed {seed} is a knowledge base the recipe uses (seeds {RECIPE_KB_SEEDS[0]}: "
            f"the evaluation's, {RECIPE_KB_SEEDS[1]}: the validation gate's); pick another"
        )
    kb_dir = kb_dir or default_cache_dir() / f"deepresearch-kb-seed{seed}"
    held = kb_seed(kb_dir)
    if (kb_dir / MANIFEST).is_file() and held != seed:
        raise ValueError(f"--kb-dir {kb_dir} holds the knowledge base of seed {held}, not {seed}")
    return build_cpu_kb(kb_dir, KBSpec(seed=seed))


def _replicas_version(urls: list[str], expected: int | None) -> int:
    """The one weight version all `urls` hold; exits with a one-line message otherwise."""
    from lockgate.examples.deepresearch.serving import weights_versions

    try:
        versions = set(weights_versions(urls))
    except RuntimeError as exc:
        sys.exit(f"evaluate: {exc}")
    if len(versions) != 1:
        sys.exit(f"evaluate: the replicas hold different weight versions {sorted(versions)}")
    (version,) = versions
    if expected is not None and version != expected:
        sys.exit(
            f"evaluate: the replicas hold weight version {version}, not {expected} "
            "(--expect-weight-version)"
        )
    return version


def _run(args: argparse.Namespace) -> int:
    from lockgate.examples.deepresearch.serving import serve_model
    from lockgate.gateway.calls.chat_format import ChatFormatError, resolve_chat_format

    version = None
    if args.replica_urls:
        version = _replicas_version(args.replica_urls, args.expect_weight_version)
    elif args.expect_weight_version is not None:
        sys.exit("evaluate: --expect-weight-version needs --replica-urls")

    try:
        kb = knowledge_base(args.kb_dir, args.kb_seed)
    except ValueError as exc:
        sys.exit(f"evaluate: {exc}")
    args.questions = args.questions or kb / HELDOUT
    corpus = args.corpus or kb / "corpus.jsonl"
    # One evaluation, one store: a rerun into the same work dir starts it afresh.
    for stale in args.work_dir.glob(RunDir(args.work_dir).store.name + "*"):
        stale.unlink()
    try:
        chat_format = resolve_chat_format(args.chat_format, args.model)
    except ChatFormatError as exc:
        sys.exit(f"evaluate: --chat-format: {exc}")
    with serve_model(
        args.model,
        corpus,
        args.work_dir,
        replicas=args.replicas,
        retrieval_url=args.retrieval_url,
        replica_urls=args.replica_urls or (),
        weights_version=version or 0,
        chat_format=chat_format,
    ) as served:
        report = asyncio.run(
            evaluate(args, served.gateway_url, served.admin_token, served.retrieval_url)
        )
    report.weights_version = version
    report.kb_seed = kb_seed(kb) if args.questions == kb / HELDOUT else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.model_dump_json(indent=1))
    if report.kb_seed is not None:
        print(f"knowledge base seed {report.kb_seed} ({kb})")
    for s in report.summaries:
        print(s.line())
    return 0


def _compare(before_path: Path, after_path: Path) -> int:
    before = Report.model_validate_json(before_path.read_text())
    after = Report.model_validate_json(after_path.read_text())
    for label, name in (("T=1", "model T=1"), ("greedy", "model T=0")):
        b, a = before.summary(name), after.summary(name)
        if b is not None and a is not None:
            print(f"held-out success ({label}): {b.success:.3f} -> {a.success:.3f}")
    return 0


def _merge(out: Path, paths: list[Path]) -> int:
    try:
        merged = merge_reports([Report.model_validate_json(p.read_text()) for p in paths])
    except (OSError, ValueError) as exc:  # a missing file, a file that is no report
        print(f"evaluate merge: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    out.write_text(merged.model_dump_json(indent=1))
    for s in merged.summaries:
        print(s.line())
    return 0


def seed_rows(runs: list[dict[str, Report]]) -> dict[str, list[float]]:
    """Held-out success over seeds, per row; `runs` holds each seed's reports by stage ("sft",
    "rl"). The gain rows pair each seed's RL model with its own SFT start: the seeds' starts
    differ by more than the gain, so the gain's spread over seeds is the one to read."""
    rows: dict[str, list[float]] = {}
    for reports in runs:
        for stage, report in reports.items():
            for s in report.summaries:
                if stage == "rl" and not s.name.startswith("model"):
                    continue  # the baselines do not change with RL
                label = s.name if not s.name.startswith("model") else f"{stage.upper()} {s.name}"
                rows.setdefault(label, []).append(s.success)
        if "sft" in reports and "rl" in reports:
            for s in reports["rl"].summaries:
                start = reports["sft"].summary(s.name)
                if s.name.startswith("model") and start is not None:
                    rows.setdefault(f"gain RL - SFT, {s.name}", []).append(
                        s.success - start.success
                    )
    return rows


def _stage_reports(run: Path, suffix: str) -> dict[str, Report]:
    """A run dir's evaluations by stage: `eval_sft{suffix}.json`, `eval_rl{suffix}.json`."""
    return {
        stage: Report.model_validate_json(path.read_text())
        for stage in ("sft", "rl")
        if (path := run / f"eval_{stage}{suffix}.json").is_file()
    }


def _table(run_dirs: list[Path]) -> int:
    """A markdown table over seeds: mean ± standard error of each row's held-out success, on
    the recipe's held-out world, then on each knowledge base of another seed evaluated as
    `eval_{sft,rl}_kb<N>.json` (`run --kb-seed N`)."""
    found = {
        p.name[len("eval_sft") : -len(".json")]
        for run in run_dirs
        for p in run.glob("eval_sft_kb*.json")
    }
    # By seed: "_kb101" -> 101; a name that is no seed sorts first.
    kbs = sorted(found, key=lambda suffix: int(suffix[3:]) if suffix[3:].isdigit() else -1)
    print("| policy | held-out success (mean ± s.e. over seeds) | seeds |\n|---|---|---|")
    for suffix in ["", *kbs]:
        where = f"KB seed {suffix.removeprefix('_kb')}: " if suffix else ""
        rows = seed_rows([_stage_reports(run, suffix) for run in run_dirs])
        for label, values in rows.items():
            n = len(values)
            mean = sum(values) / n
            var = sum((v - mean) ** 2 for v in values) / (n - 1) / n if n > 1 else math.nan
            sign = "+" if label.startswith("gain") else ""
            print(f"| {where}{label} | {mean:{sign}.3f} ± {math.sqrt(var):.3f} | {n} |")
    return 0


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m lockgate.examples.deepresearch.evaluate")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="evaluate a model (and the baselines) on held-out questions")
    run.add_argument("--model", type=Path, required=True, help="HF model dir")
    run.add_argument(
        "--chat-format",
        default="auto",
        help="the model's chat format, as a run config's model.chat_format (default: auto, "
        "read from the model's files)",
    )
    run.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    run.add_argument(
        "--kb-dir",
        type=Path,
        help="the knowledge base (default: the CPU one in the cache; with --kb-seed, where it "
        "is built)",
    )
    run.add_argument(
        "--kb-seed",
        type=int,
        metavar="N",
        help="evaluate on a CPU knowledge base built with seed N, one the recipe never used: "
        "a new held-out world, its questions and documents",
    )
    run.add_argument("--questions", type=Path, help="question JSONL (default: the held-out set)")
    run.add_argument("--corpus", type=Path, help="corpus JSONL (default: the knowledge base's)")
    run.add_argument("--n", type=int, default=None, help="the first N questions only")
    run.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    run.add_argument(
        "--samples",
        type=int,
        default=1,
        help="episodes per question at a temperature above 0 (greedy runs once)",
    )
    run.add_argument("--oracle", action="store_true", help="also run the scripted oracle")
    run.add_argument("--no-search", action="store_true", help="also run the no-search baseline")
    run.add_argument("--agent", default="{}", help="AgentConfig fields as JSON")
    run.add_argument("--replicas", type=int, default=2, help="local replicas to start")
    run.add_argument(
        "--replica-urls",
        nargs="+",
        metavar="URL",
        help="use these running lockgate replicas (`lockgate replicas`) instead of starting any: "
        "they hold --model's weights or those a training run synced into them",
    )
    run.add_argument(
        "--expect-weight-version",
        type=int,
        metavar="N",
        help="with --replica-urls: fail unless they hold weight version N (a run's last step)",
    )
    run.add_argument("--concurrency", type=int, default=32)
    run.add_argument("--retrieval-url", help="use this running retrieval service")
    run.add_argument("--work-dir", type=Path, help="logs and store (default: beside --out)")
    compare = sub.add_parser("compare", help="print held-out success before -> after")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    table = sub.add_parser("table", help="mean ± s.e. over seeds of each run's eval_*.json")
    table.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    merge = sub.add_parser(
        "merge", help="pool evaluations of one model (more episodes per question) into OUT"
    )
    merge.add_argument("out", type=Path, metavar="OUT")
    merge.add_argument("reports", type=Path, nargs="+", metavar="EVAL_JSON")
    args = parser.parse_args(argv)
    if args.command == "merge":
        return _merge(args.out, args.reports)
    if args.command == "table":
        return _table(args.run_dirs)
    if args.command == "compare":
        return _compare(args.before, args.after)
    args.work_dir = args.work_dir or args.out.with_suffix("")
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
