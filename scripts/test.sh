#!/usr/bin/env bash
# The one test command (`make test`): venv, dependencies, services, lint, then the suite twice —
# on the embedded default (SQLite, in-process channel layer) and on PostgreSQL + Redis.
# Where PostgreSQL or Redis is absent, the second pass is skipped with the reason; under CI (CI=true) it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
bash scripts/bootstrap.sh dev
bash scripts/system-deps.sh
bash scripts/services.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "==> ruff"
ruff check .

PG_URL="${CLUSTERDX_TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/clusterdx}"
RD_URL="${CLUSTERDX_TEST_REDIS_URL:-redis://127.0.0.1:6379/14}"
missing=$(python - "$PG_URL" "$RD_URL" <<'PY'
import sys
reasons = []
try:
    import psycopg
    psycopg.connect(sys.argv[1].rsplit("/", 1)[0] + "/postgres", connect_timeout=3).close()
except Exception as exc:
    reasons.append(f"PostgreSQL at {sys.argv[1]}: {str(exc).strip().splitlines()[0]}")
try:
    import redis
    redis.Redis.from_url(sys.argv[2], socket_connect_timeout=3).ping()
except Exception as exc:
    reasons.append(f"Redis at {sys.argv[2]}: {exc}")
print("; ".join(reasons))
PY
)

echo "==> tests, embedded default (SQLite + in-process layers)"
env -u DATABASE_URL -u REDIS_URL CLUSTERDX_DATA_DIR="$PWD/var/test-embedded" \
  python -m pytest -p no:cacheprovider "$@"

if [ -n "$missing" ]; then
  if [ "${CI:-}" = "true" ] || [ "${CI:-}" = "1" ]; then
    echo "!! CI=true and a service is missing: $missing"
    exit 1
  fi
  echo "==> SKIPPED the PostgreSQL + Redis pass: $missing"
else
  echo "==> server tests again on PostgreSQL + Redis"
  DATABASE_URL="$PG_URL" REDIS_URL="$RD_URL" CLUSTERDX_DATA_DIR="$PWD/var/test-prod" \
  CLUSTERDX_REDIS_PREFIX="cdxtest$$" python -m pytest -p no:cacheprovider -m "not browser" tests/server "$@"
fi
echo "==> all tests passed in $(( $(date +%s) - started )) s"
