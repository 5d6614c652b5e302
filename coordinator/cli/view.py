"""`lockgate view RUN_DIR`: the trajectory viewer and run dashboard on a run's store, read-only
(the serving itself is lockgate.gateway.viewer.serve; docs/viewer.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lockgate.coordinator.cli.options import Subcommands
from lockgate.coordinator.run_dir import RunDir

if TYPE_CHECKING:
    from lockgate.gateway.viewer.serve import RunFiles


def add_parser(sub: Subcommands) -> None:
    view = sub.add_parser(
        "view",
        help="browse a run's trajectories and metrics in the browser (read-only)",
        description="Serve the trajectory viewer and run dashboard on RUN_DIR's store "
        "(trajectories.sqlite) and metrics.jsonl, read-only, and print the URL to open "
        "(it carries the access token once; the browser keeps a cookie).",
    )
    view.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run dir or a store file")
    view.add_argument("--host", default="127.0.0.1", help="address to listen on")
    view.add_argument("--port", type=int, default=8765)
    view.add_argument("--token", help="access token (default: a random one, printed with the URL)")
    view.add_argument(
        "--store",
        help="store file inside RUN_DIR (default trajectories.sqlite; "
        "val_trajectories.sqlite holds the validation rollouts)",
    )
    view.add_argument(
        "--model-dir", type=Path, help="tokenizer for token texts (default: the run's model)"
    )
    view.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # A run dir or store that is not there is reported here (`lockgate view: ...`, exit 2).
    from lockgate.gateway.viewer.serve import view  # fastapi and uvicorn only when viewing

    try:
        files = find_run_files(args.run_dir, args.store, args.model_dir)
    except ValueError as exc:
        print(f"lockgate view: {exc}", file=sys.stderr)
        return 2
    return view(files, host=args.host, port=args.port, token=args.token)


def find_run_files(run: Path, store: str | None = None, model_dir: Path | None = None) -> RunFiles:
    """The files `lockgate view RUN` serves, found through the run dir's layout: RUN's store
    (`store` names another of its stores) or a store file given directly, the run's metrics,
    and the config of the gateway that wrote the store (the training gateway's where that one
    left none). Raises ValueError with a one-line message when there is no run dir or store."""
    from lockgate.gateway.viewer.serve import read_run_files  # fastapi only when viewing

    if run.is_file():
        run_dir, db = RunDir(run.parent), run
    elif run.is_dir():
        run_dir = RunDir(run)
        db = run_dir.store_named(store) if store else run_dir.store
    else:
        raise ValueError(f"run dir not found: {run}")
    config = run_dir.config_of_store(db)
    if not config.is_file():
        config = run_dir.gateway_config
    return read_run_files(db, metrics=run_dir.metrics, gateway_config=config, model_dir=model_dir)
