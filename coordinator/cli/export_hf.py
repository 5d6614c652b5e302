"""`lockgate export-hf SNAPSHOT OUT [--merge [--base DIR]]`: a run's weight snapshot in HF layout,
which transformers and any vLLM load, or a LoRA adapter merged into its base model's weights
(the conversion and the merge are the trainer's, trainer/export.py and trainer/lora.py)."""

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
        "checkpoint's tensors. A LoRA run's step_N is an adapter dir (adapter_config.json): "
        "--merge writes its base model with the adapter merged in (W + alpha/r * B@A); the "
        "adapter dir itself already loads in vLLM and peft as it is.",
    )
    export.add_argument("snapshot", type=Path, metavar="SNAPSHOT", help="a snapshot dir")
    export.add_argument("out", type=Path, metavar="OUT", help="where to write the HF snapshot")
    export.add_argument(
        "--merge",
        action="store_true",
        help="SNAPSHOT is a LoRA adapter dir: write its base model with the adapter merged in",
    )
    export.add_argument(
        "--base",
        type=Path,
        metavar="DIR",
        help="with --merge: the base model dir (default: the adapter's base_model_name_or_path)",
    )
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # torch is slow to import
    from lockgate.trainer.export import to_hf
    from lockgate.trainer.lora import is_adapter_dir, merge_adapter

    snapshot, out = args.snapshot, args.out
    if out.resolve() == snapshot.resolve():
        raise UsageError("OUT must differ from SNAPSHOT")
    adapter = is_adapter_dir(snapshot)
    if adapter and not args.merge:
        raise UsageError(
            f"{snapshot} is a LoRA adapter: pass --merge to write merged HF weights "
            "(vLLM and peft load the adapter dir as it is)"
        )
    if args.merge and not adapter:
        raise UsageError(f"--merge needs a LoRA adapter dir; {snapshot} has no adapter_config.json")
    if args.base is not None and not args.merge:
        raise UsageError("--base only goes with --merge")
    # The trainer's errors are its own: a snapshot it cannot read is bad input here.
    try:
        print(merge_adapter(snapshot, out, args.base) if adapter else to_hf(snapshot, out))
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot export {snapshot}: {exc}") from exc
    return 0
