"""Run the gateway as its own process: `python -m lockgate.gateway --config gateway.json`.

`lockgate gateway` does the same from the run config's sections (coordinator/cli/deploy.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lockgate.gateway.api.server import configure_logging, serve
from lockgate.gateway.config import ADMIN_TOKEN_ENV, GatewayConfig


def load_config(path: Path) -> GatewayConfig:
    """The config file's gateway; an `admin_token` the file leaves out comes from
    $LOCKGATE_ADMIN_TOKEN, so the file can be kept or shared without the secret."""
    raw = json.loads(path.read_text())
    if isinstance(raw, dict) and "admin_token" not in raw and os.environ.get(ADMIN_TOKEN_ENV):
        raw["admin_token"] = os.environ[ADMIN_TOKEN_ENV]
    return GatewayConfig.model_validate(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description="lockgate's OpenAI-compatible gateway")
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help=f"GatewayConfig as JSON; without admin_token, ${ADMIN_TOKEN_ENV} gives it",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    try:
        config = load_config(args.config)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        sys.exit(f"lockgate.gateway: --config {args.config}: {exc}")
    configure_logging()
    serve(config, args.host, args.port)


if __name__ == "__main__":
    main()
