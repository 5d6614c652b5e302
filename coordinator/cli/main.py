"""The `lockgate` command line: `train`, `sft`, `report`, `view`, `export-hf`, `build-model`, and
the parts as services: `replicas`, `gateway`, `serve`, `session new` (deploy_commands.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lockgate.coordinator.cli.deploy import (
    DEPLOY_COMMANDS,
    add_deploy_parsers,
    overrides_with_env,
    run_deploy_command,
)
from lockgate.coordinator.cli.errors import config_error as _config_error
from lockgate.coordinator.cli.errors import error as _error
from lockgate.coordinator.cli.view import add_view_parser, run_view
from lockgate.coordinator.config import describe_options, load_config, read_config_file
from lockgate.coordinator.launch.deploy_checks import DeployError
from lockgate.coordinator.launch.gateway import GatewayDied, GatewayStartError
from lockgate.coordinator.launch.parts import run_dir_of
from lockgate.coordinator.launch.replicas import ReplicaStartError, usable_cpus
from lockgate.trainer.protocol import write_atomic
from lockgate.trainer.sft.config import SFTConfig


def _add_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override an option, e.g. {example}",
    )


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
        epilog="config options (YAML/TOML sections; then LOCKGATE_<SECTION>__<FIELD> environment "
        "variables; override any with --set):\n" + "\n".join(describe_options()),
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
    _add_overrides(train, "loop.steps=5")
    train.add_argument("--run-dir", type=Path, help="override run_dir")
    _add_sft_parser(sub)
    add_deploy_parsers(sub)
    add_view_parser(sub)
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
    from lockgate.coordinator.metrics.report import ReportError, write_report  # matplotlib is slow

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


# -- lockgate sft ---------------------------------------------------------------------------------


def _add_sft_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat JSONL (loss on assistant tokens only)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize the chats with the model's chat template, train on the trainer's "
        "FSDP2 ranks (torchrun), and write OUT/final/, an HF model dir (usable as model.path of "
        "an RL run). OUT also holds metrics.jsonl, checkpoints/ and sft.log.",
        epilog="config options (YAML/TOML sections; override any with --set):\n"
        + "\n".join(describe_options(SFTConfig)),
    )
    sft.add_argument("config", type=Path, help="SFT config file (.yaml, .yml or .toml)")
    _add_overrides(sft, "loop.max_steps=50")
    sft.add_argument("--out", type=Path, help="override out_dir")
    sft.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUT from its newest checkpoint (the same data and batch "
        "options; a longer loop.max_steps or more loop.epochs extend it); a fresh start when "
        "OUT holds none. Without it an OUT that holds a run is refused.",
    )


def _load_sft(path: Path, overrides: list[str], out: Path | None) -> SFTConfig:
    config = SFTConfig.model_validate(read_config_file(path, overrides))
    model_dir = config.model.path
    if model_dir is None:
        from lockgate.trainer.tiny_models.builder import ensure_tiny_model

        model_dir = ensure_tiny_model()
    resolved = config.resolved(path.parent, model_dir)
    if out is not None:
        resolved.out_dir = out.resolve()
    return resolved


def _check_out(config: SFTConfig, resume: bool) -> bool:
    """Whether OUT holds the run to resume (its tokenized data is then reused as it is)."""
    layout = config.layout
    if not layout.config.exists():
        return False
    if not resume:
        raise ValueError(
            f"{layout.out} holds an earlier run: pass --resume to continue it, or choose "
            "another out_dir (--out)"
        )
    before = SFTConfig.model_validate_json(layout.config.read_text()).data_order()
    changed = [k for k, v in config.data_order().items() if before[k] != v]
    if changed:
        raise ValueError(
            f"--resume: {', '.join(changed)} differ from the run in {layout.out}, so its steps "
            "would train other conversations; use the same options or another out_dir"
        )
    return layout.train_data.exists()


def _prepare_sft_data(config: SFTConfig) -> None:
    """Tokenize the train (and val) chats into OUT/data/, printing what was cut or dropped."""
    from lockgate.trainer.sft.data import load_tokenizer, tokenize_file, write_examples

    layout, data = config.layout, config.data
    splits = [("train", data.path, layout.train_data), ("val", data.val_path, layout.val_data)]
    for _, source, _ in splits:
        if source is not None and not source.is_file():
            raise FileNotFoundError(2, "no such file", str(source))  # before the slow tokenizer
    tokenizer = load_tokenizer(config.model_dir)
    stats = {}
    for name, source, target in splits:
        if source is None:
            continue
        examples, stats[name] = tokenize_file(
            source,
            tokenizer,
            max_length=data.max_length,
            overlong=data.overlong,
            end_of_turn=data.end_of_turn,
            workers=len(usable_cpus()),
        )
        if not examples:
            raise ValueError(f"{source}: no conversation has an assistant token to train on")
        write_examples(examples, target)
        print(f"sft data: {stats[name].summary(name)}", file=sys.stderr, flush=True)
    layout.data_stats.write_text(json.dumps({k: vars(v) for k, v in stats.items()}, indent=2))


def _follow(proc: subprocess.Popen[bytes], log_path: Path, offset: int) -> int:
    """Echo the ranks' progress lines ("sft ...") from the log until the ranks exit."""
    pending = b""
    with log_path.open("rb") as log:
        log.seek(offset)
        while True:
            done = proc.poll() is not None
            # Only whole lines: a line being written is finished on a later read.
            *lines, pending = (pending + log.read()).split(b"\n")
            for line in lines if not done else [*lines, pending]:
                text = line.decode(errors="replace")
                if text.startswith("sft "):
                    print(text, file=sys.stderr, flush=True)
            if done:
                return int(proc.returncode)
            time.sleep(0.2)


def _run_sft(config: SFTConfig, resume: bool) -> int:
    from lockgate.coordinator.launch.processes import terminate
    from lockgate.coordinator.launch.trainer import spawn_ranks

    layout = config.layout
    layout.failed.unlink(missing_ok=True)
    offset = layout.log.stat().st_size if layout.log.exists() else 0
    proc = spawn_ranks(
        "lockgate.trainer.sft.main",
        ["--config", str(layout.config), *(["--resume"] if resume else [])],
        world_size=config.trainer.world_size,
        num_threads=config.trainer.num_threads,
        log_path=layout.log,
        alone=True,
    )
    try:
        code = _follow(proc, layout.log, offset)
    finally:
        terminate(proc)  # a no-op once torchrun has exited; stops the ranks on Ctrl-C
    if code != 0:
        why = " ".join(layout.failed.read_text().split()) if layout.failed.exists() else ""
        return _error(f"sft failed: {why or f'exit code {code}'} (log: {layout.log})", 1)
    print(layout.final)
    return 0


def _sft(path: Path, overrides: list[str], out: Path | None, *, resume: bool) -> int:
    try:
        config = _load_sft(path, overrides, out)
    except (ValueError, OSError) as exc:
        return _config_error(path, exc)
    try:
        reuse_data = _check_out(config, resume)
        config.layout.out.mkdir(parents=True, exist_ok=True)
        if not reuse_data:
            _prepare_sft_data(config)
        write_atomic(config.layout.config, config.model_dump_json(indent=2))
    except FileNotFoundError as exc:
        return _error(f"data file not found: {exc.filename}")
    except (ValueError, OSError) as exc:
        return _error(" ".join(str(exc).split()))
    try:
        return _run_sft(config, resume)
    except KeyboardInterrupt:
        return _error("interrupted; all processes stopped", 130)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in DEPLOY_COMMANDS:
        return run_deploy_command(args)
    if args.command == "export-hf":
        return _export_hf(args.snapshot, args.out)
    if args.command == "build-model":
        from lockgate.trainer.tiny_models.builder import ensure_tiny_model

        print(ensure_tiny_model())
        return 0
    if args.command == "report":
        return _report(args.run_dirs, args.out)
    if args.command == "view":
        return run_view(args)
    if args.command == "sft":
        return _sft(args.config, args.set, args.out, resume=args.resume)
    if (args.config is None) == (args.resume is None):
        return _error("train takes a CONFIG file or --resume RUN_DIR (exactly one)")
    config_path = args.config if args.resume is None else args.resume / "config.json"
    try:
        config = load_config(config_path, overrides_with_env(args.set))
    except (ValueError, OSError) as exc:
        return _config_error(config_path, exc)
    if args.resume is not None:
        config.run_dir = args.resume
    if args.run_dir is not None:
        config.run_dir = args.run_dir

    from lockgate.coordinator.launch.local import RunStopped, train  # heavy: only when training

    try:
        summary = train(config, resume=args.resume is not None)
    except KeyboardInterrupt:
        # 128 + SIGINT, as a shell reports a command Ctrl-C ended (and `lockgate sft` does).
        return _error(
            f"interrupted; all processes stopped (continue with: lockgate train --resume "
            f"{run_dir_of(config)})",
            130,
        )
    except (GatewayDied, RunStopped) as exc:
        return _error(str(exc), 1)
    except DeployError as exc:  # bad deploy input, found before anything started
        return _error(str(exc))
    except (ReplicaStartError, GatewayStartError) as exc:
        return _error(str(exc), 1)
    first, last = summary.first_last()
    print(
        f"done: {summary.steps} steps in {summary.elapsed_s:.0f}s, weights version {summary.version}\n"
        f"mean reward: first steps {first:.3f} -> last steps {last:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
