"""`lockgate train`: a whole run on this machine (replicas, gateway, trainer ranks, the loop),
or `--resume RUN_DIR` to continue one from its newest checkpoint (coordinator/launch/local.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockgate.coordinator.cli.options import Subcommands, add_overrides, load_run_config
from lockgate.coordinator.config import describe_options
from lockgate.coordinator.errors import Interrupted, UsageError
from lockgate.coordinator.launch.parts import run_dir_of
from lockgate.coordinator.run_dir import RunDir


def add_parser(sub: Subcommands) -> None:
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
    add_overrides(train, "loop.steps=5")
    train.add_argument("--run-dir", type=Path, help="override run_dir")
    train.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.resume is None):
        raise UsageError("train takes a CONFIG file or --resume RUN_DIR (exactly one)")
    config_path = args.config if args.resume is None else RunDir(args.resume).config
    config = load_run_config(config_path, args.set)
    if args.resume is not None:
        config.run_dir = args.resume
    if args.run_dir is not None:
        config.run_dir = args.run_dir

    from lockgate.coordinator.launch.local import train  # heavy: only when training

    try:
        summary = train(config, resume=args.resume is not None)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted; all processes stopped (continue with: lockgate train --resume "
            f"{run_dir_of(config)})"
        ) from None
    first, last = summary.first_last()
    print(
        f"done: {summary.steps} steps in {summary.elapsed_s:.0f}s, weights version {summary.version}\n"
        f"mean reward: first steps {first:.3f} -> last steps {last:.3f}",
        flush=True,
    )
    return 0
