"""`lockgate view RUN_DIR`: the viewer alone, on a run's store, read-only.

The coordinator's command finds the run's files (it owns the run dir's layout,
coordinator/run_dir.py) and gives their paths here: the store, the metrics file for the
dashboard, and the config of the gateway that wrote the store, whose `model_dir` gives the token
texts and `advantages` how the run computed the advantages it trained on. The store is opened
read-only and nothing is written beside it (routes.py, `open_read_only`); a run that is still
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


@dataclass(frozen=True)
class RunFiles:
    store: Path
    metrics: Path | None  # None: no dashboard
    model_dir: Path | None
    advantages: AdvantageSpec | None = None  # None: the run's config does not say (GRPO shown)


def read_run_files(
    store: Path,
    *,
    metrics: Path | None,
    gateway_config: Path | None,
    model_dir: Path | None = None,
) -> RunFiles:
    """The run's files from their paths: the tokenizer (`model_dir`, else the gateway config's)
    and the advantage spec are read from `gateway_config` when it can be read. Raises
    ValueError with a one-line message when there is no store, or when the run's advantage spec
    does not parse."""
    if not store.is_file():
        raise ValueError(f"no trajectory store at {store} (is {store.parent} a run dir?)")
    read: object = None
    if gateway_config is not None:
        with contextlib.suppress(OSError, ValueError):
            read = json.loads(gateway_config.read_text())
    written: dict[str, Any] = read if isinstance(read, dict) else {}
    if model_dir is None:
        found = written.get("model_dir")
        model_dir = Path(found) if isinstance(found, str) and found else None
    return RunFiles(
        store=store,
        metrics=metrics,
        model_dir=model_dir,
        advantages=_advantages(gateway_config, written.get("advantages")),
    )


def _advantages(config: Path | None, raw: object) -> AdvantageSpec | None:
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
    files: RunFiles,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
) -> int:
    """Serve the viewer on `files` until interrupted; returns the exit code."""
    import uvicorn

    token = token or secrets.token_urlsafe(18)
    shown = "localhost" if host in ("127.0.0.1", "0.0.0.0") else host
    print(
        f"lockgate view: {files.store} (read-only)\n  open http://{shown}:{port}/ui/?token={token}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(create_view_app(files, token), host=host, port=port, log_level="warning")
    return 0
