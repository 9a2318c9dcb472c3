#!/usr/bin/env bash
# Creates .venv and installs clusterdx with the extras given (default: the server only).
# torch is pinned and installed first when an extra needs it: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=".venv/.installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> installing clusterdx${extras:+[$extras]} into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  fi
  .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
  touch "$stamp"
fi
