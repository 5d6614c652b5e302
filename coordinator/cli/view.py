"""`lockgate view RUN_DIR`: the trajectory viewer and run dashboard on a run's store, read-only
(the serving itself is lockgate.gateway.viewer.serve; docs/viewer.md)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_view_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def run_view(args: argparse.Namespace) -> int:
    from lockgate.gateway.viewer.serve import view  # fastapi and uvicorn only when viewing

    return view(
        args.run_dir,
        host=args.host,
        port=args.port,
        token=args.token,
        store=args.store,
        model_dir=args.model_dir,
    )
