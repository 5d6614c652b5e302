"""Run the gateway as its own process: `python -m lockgate.gateway --config gateway.json`.

`lockgate gateway` does the same from the run config's sections (coordinator/deploy_commands.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockgate.gateway.api.server import configure_logging, serve
from lockgate.gateway.config import GatewayConfig


def main() -> None:
    parser = argparse.ArgumentParser(description="lockgate's OpenAI-compatible gateway")
    parser.add_argument("--config", type=Path, required=True, help="GatewayConfig as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    configure_logging()
    serve(GatewayConfig.model_validate_json(args.config.read_text()), args.host, args.port)


if __name__ == "__main__":
    main()
