"""`lockgate export-hf SNAPSHOT OUT`: a run's weight snapshot in HF layout, which transformers
and any vLLM load (the conversion is the trainer's, trainer/export.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockgate.coordinator.cli.options import Subcommands
from lockgate.coordinator.errors import UsageError


def add_parser(sub: Subcommands) -> None:
    export = sub.add_parser(
        "export-hf",
        help="write a weight snapshot in HF layout (transformers and any vLLM load it)",
        description="Copy SNAPSHOT (a run's trainer/weights/step_N) to OUT in HF layout, "
        "turning weights the trainer stored in the replicas' kernel layout back into the "
        "checkpoint's tensors.",
    )
    export.add_argument("snapshot", type=Path, metavar="SNAPSHOT", help="a snapshot dir")
    export.add_argument("out", type=Path, metavar="OUT", help="where to write the HF snapshot")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lockgate.trainer.export import to_hf  # torch is slow to import

    snapshot, out = args.snapshot, args.out
    if out.resolve() == snapshot.resolve():
        raise UsageError("OUT must differ from SNAPSHOT")
    # The trainer's errors are its own: a snapshot it cannot read is bad input here.
    try:
        print(to_hf(snapshot, out))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot export {snapshot}: {exc}") from exc
    return 0
