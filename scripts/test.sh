#!/usr/bin/env bash
# The one test command (`make test`): venv, dependencies, services, lint, then the suite twice —
# on the embedded default (SQLite, in-process channel layer) and on PostgreSQL + Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev
bash scripts/system-deps.sh
bash scripts/services.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "==> ruff"
ruff check .
PG_URL="${CLUSTERDX_TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/clusterdx}"
RD_URL="${CLUSTERDX_TEST_REDIS_URL:-redis://127.0.0.1:6379/14}"
echo "==> tests, embedded default (SQLite + in-process layers)"
env -u DATABASE_URL -u REDIS_URL CLUSTERDX_TEST_DATABASE_URL="$PG_URL" CLUSTERDX_TEST_REDIS_URL="$RD_URL" \
  python -m pytest -p no:cacheprovider "$@"
echo "==> server tests again on PostgreSQL + Redis"
DATABASE_URL="$PG_URL" REDIS_URL="$RD_URL" CLUSTERDX_TEST_DATABASE_URL="$PG_URL" CLUSTERDX_TEST_REDIS_URL="$RD_URL" \
  python -m pytest -p no:cacheprovider -m "not browser" tests/server "$@"
