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

# The browser's smaller plotly bundles: basic (scatter, bar: 1.2 MB) and cartesian (with heatmaps: 1.5 MB) instead
# of the full 4.8 MB, evaluated in a fifth and a third of its time. From the npm registry, pinned by dashboard/web/npm/package-lock.json; where npm
# is missing or offline the pages use the plotly Python package's full bundle instead.
deps=dashboard/web/npm
if [ ! -d "$deps/node_modules" ] || [ "$deps/package-lock.json" -nt "$deps/node_modules" ]; then
  if command -v npm >/dev/null 2>&1; then
    echo "==> npm ci in $deps (plotly's basic and cartesian bundles)"
    if npm ci --prefix "$deps" --omit=dev --no-audit --no-fund --loglevel=error; then
      touch "$deps/node_modules"
    else
      echo "!! npm ci failed: the pages will load the full plotly.js from the plotly Python package"
    fi
  else
    echo "==> npm not found: the pages will load the full plotly.js from the plotly Python package"
  fi
fi
