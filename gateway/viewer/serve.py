"""`lockgate view RUN_DIR`: the viewer alone, on a run's store, read-only.

The run dir is what `lockgate train` wrote: `trajectories.sqlite` (or another store named with
`--store`, such as `val_trajectories.sqlite`), `metrics.jsonl` for the dashboard, and
`gateway_config.json`, whose `model_dir` gives the token texts and `advantages` how the run
computed the advantages it trained on. The store is opened read-only
and nothing is written in the run dir (routes.py, `open_read_only`); a run that is still
training can be viewed too: the live feed shows what its gateway records.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError

from lockgate.gateway.records.advantages import AdvantageSpec
from lockgate.gateway.viewer.routes import Viewer, ViewerSource, viewer_routes

STORE_FILE = "trajectories.sqlite"


@dataclass(frozen=True)
class RunFiles:
    store: Path
    metrics: Path
    model_dir: Path | None
    advantages: AdvantageSpec | None = None  # None: the run's config does not say (GRPO shown)


def find_run_files(run: Path, store: str | None = None, model_dir: Path | None = None) -> RunFiles:
    """The store, metrics and tokenizer of a run dir (or of a store file given directly).
    Raises ValueError with a one-line message when there is no store, or when the run's
    advantage spec does not parse."""
    if run.is_file():
        db, run_dir = run, run.parent
    else:
        if not run.is_dir():
            raise ValueError(f"run dir not found: {run}")
        db, run_dir = run / (store or STORE_FILE), run
    if not db.is_file():
        raise ValueError(f"no trajectory store at {db} (is {run_dir} a run dir?)")
    config = run_dir / ("val_gateway_config.json" if db.name.startswith("val_") else "")
    config = config if config.is_file() else run_dir / "gateway_config.json"
    gateway_config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        read = json.loads(config.read_text())
        gateway_config = read if isinstance(read, dict) else {}
    if model_dir is None:
        found = gateway_config.get("model_dir")
        model_dir = Path(found) if isinstance(found, str) and found else None
    return RunFiles(
        store=db,
        metrics=run_dir / "metrics.jsonl",
        model_dir=model_dir,
        advantages=_advantages(config, gateway_config.get("advantages")),
    )


def _advantages(config: Path, raw: object) -> AdvantageSpec | None:
    """The run's advantage spec; None where its config has none (a run from before the gateway
    carried it). A spec that does not parse is an error: the viewer would show wrong numbers."""
    if raw is None:
        return None
    try:
        return AdvantageSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{config}: advantages.{where}: {first['msg']}") from exc


def create_view_app(files: RunFiles, token: str) -> FastAPI:
    viewer = Viewer(
        ViewerSource(
            db_path=files.store,
            admin_token=token,
            metrics_path=files.metrics,
            model_dir=files.model_dir,
            advantages=files.advantages,
            title=f"lockgate view: {files.store.parent.name}",
            extra={"run": str(files.store.parent), "read_only": True},
        )
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            viewer.close()

    app = FastAPI(title="lockgate viewer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(viewer_routes(viewer))
    return app


def view(
    run: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    store: str | None = None,
    model_dir: Path | None = None,
) -> int:
    """Serve the viewer until interrupted; returns the exit code."""
    import uvicorn

    try:
        files = find_run_files(run, store, model_dir)
    except ValueError as exc:
        print(f"lockgate view: {exc}", file=sys.stderr)
        return 2
    token = token or secrets.token_urlsafe(18)
    shown = "localhost" if host in ("127.0.0.1", "0.0.0.0") else host
    print(
        f"lockgate view: {files.store} (read-only)\n  open http://{shown}:{port}/ui/?token={token}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(create_view_app(files, token), host=host, port=port, log_level="warning")
    return 0
