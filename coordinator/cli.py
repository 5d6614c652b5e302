"""The `lockgate` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from lockgate.coordinator.config import describe_options, load_config


def _error(message: str) -> int:
    print(f"lockgate: {message}", file=sys.stderr)
    return 2


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"config error: {where}: {first['msg']}{more}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockgate", description="Fully-asynchronous RL for LLM agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="run a training job on this machine (replicas, gateway, trainer, loop)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start local vLLM replicas, the gateway and trainer ranks, and train.",
        epilog="config options (YAML/TOML sections; override any with --set):\n"
        + "\n".join(describe_options()),
    )
    train.add_argument(
        "config", type=Path, nargs="?", help="run config file (.yaml, .yml or .toml)"
    )
    train.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue a stopped or killed run from its newest trainer checkpoint (needs "
        "trainer.checkpoint_every > 0); its config is RUN_DIR/config.json, --set still applies",
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an option, e.g. loop.steps=5",
    )
    train.add_argument("--run-dir", type=Path, help="override run_dir")
    sub.add_parser(
        "build-model", help="build (or find cached) the tiny offline test model; print its path"
    )
    export = sub.add_parser(
        "export-hf",
        help="write a weight snapshot in HF layout (transformers and any vLLM load it)",
        description="Copy SNAPSHOT (a run's trainer/weights/step_N) to OUT in HF layout, "
        "turning weights the trainer stored in the replicas' kernel layout back into the "
        "checkpoint's tensors.",
    )
    export.add_argument("snapshot", type=Path, metavar="SNAPSHOT", help="a snapshot dir")
    export.add_argument("out", type=Path, metavar="OUT", help="where to write the HF snapshot")
    report = sub.add_parser(
        "report",
        help="plot a run's metrics into RUN_DIR/report/ (or compare several runs)",
        description="Write PNG plots and a self-contained report.html from each run's "
        "metrics.jsonl. One run: RUN_DIR/report/ by default. Several runs: their reward curves "
        "overlaid, written to --out.",
    )
    report.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a run dir")
    report.add_argument("--out", type=Path, help="output dir (needed with several runs)")
    return parser


def _report(run_dirs: list[Path], out: Path | None) -> int:
    from lockgate.coordinator.report import ReportError, write_report  # matplotlib is slow

    try:
        report = write_report(run_dirs, out)
    except ReportError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"cannot write the report: {exc}")
    print(report.html)
    return 0


def _export_hf(snapshot: Path, out: Path) -> int:
    from lockgate.trainer.export import to_hf  # torch is slow to import

    if out.resolve() == snapshot.resolve():
        return _error("OUT must differ from SNAPSHOT")
    try:
        print(to_hf(snapshot, out))
    except (OSError, ValueError) as exc:
        return _error(f"cannot export {snapshot}: {exc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export-hf":
        return _export_hf(args.snapshot, args.out)
    if args.command == "build-model":
        from lockgate.trainer.tiny_model import ensure_tiny_model

        print(ensure_tiny_model())
        return 0
    if args.command == "report":
        return _report(args.run_dirs, args.out)
    if (args.config is None) == (args.resume is None):
        return _error("train takes a CONFIG file or --resume RUN_DIR (exactly one)")
    config_path = args.config if args.resume is None else args.resume / "config.json"
    try:
        config = load_config(config_path, args.set)
    except FileNotFoundError as exc:
        return _error(f"config file not found: {exc.filename}")
    except ValidationError as exc:
        return _error(_validation_message(exc))
    except (ValueError, OSError) as exc:
        return _error(f"{config_path}: {exc}")
    if args.resume is not None:
        config.run_dir = args.resume
    if args.run_dir is not None:
        config.run_dir = args.run_dir

    from lockgate.coordinator.launch import train  # heavy imports only when training

    try:
        summary = train(config, resume=args.resume is not None)
    except KeyboardInterrupt:
        return _error("interrupted; all processes stopped")
    first, last = summary.first_last()
    print(
        f"done: {summary.steps} steps in {summary.elapsed_s:.0f}s, weights version {summary.version}\n"
        f"mean reward: first steps {first:.3f} -> last steps {last:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
