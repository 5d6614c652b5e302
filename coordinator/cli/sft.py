"""`lockgate sft CONFIG`: supervised fine-tuning on chat JSONL; the launcher is
coordinator/launch/sft.py, this module only parses."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockgate.coordinator.cli.options import Subcommands, add_overrides
from lockgate.coordinator.config import describe_options
from lockgate.coordinator.launch.sft import sft
from lockgate.trainer.sft.config import SFTConfig


def add_parser(sub: Subcommands) -> None:
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat JSONL (loss on assistant tokens only)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize the chats in the model's chat format, train on the trainer's "
        "FSDP2 ranks (torchrun), and write OUT/final/, an HF model dir (usable as model.path of "
        "an RL run). OUT also holds metrics.jsonl, checkpoints/ and sft.log.",
        epilog="config options (YAML/TOML sections; override any with --set):\n"
        + "\n".join(describe_options(SFTConfig)),
    )
    sft.add_argument("config", type=Path, help="SFT config file (.yaml, .yml or .toml)")
    add_overrides(sft, "loop.max_steps=50")
    sft.add_argument("--out", type=Path, help="override out_dir")
    sft.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUT from its newest checkpoint (the same data and batch "
        "options; a longer loop.max_steps or more loop.epochs extend it); a fresh start when "
        "OUT holds none. Without it an OUT that holds a run is refused.",
    )
    sft.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(sft(args.config, args.set, args.out, resume=args.resume))
    return 0
