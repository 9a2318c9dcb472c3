#!/usr/bin/env bash
# Starts PostgreSQL and Redis when they are installed but not running. Prints what it did; never fails by itself:
# the tests decide whether a missing service is a skip (a laptop) or a failure (CI=true).
set -u
if command -v pg_lsclusters >/dev/null 2>&1; then
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    ver=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$ver" ]; then
      echo "==> starting PostgreSQL $ver"
      pg_ctlcluster --skip-systemctl-redirect "$ver" main start || echo "!! could not start PostgreSQL"
    fi
  fi
fi
if command -v redis-server >/dev/null 2>&1; then
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    echo "==> starting Redis"
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log || echo "!! could not start Redis"
  fi
fi
for _ in $(seq 1 20); do
  pg_ok=1; redis_ok=1
  command -v pg_isready >/dev/null 2>&1 && ! pg_isready -q -h 127.0.0.1 -p 5432 && pg_ok=0
  command -v redis-cli >/dev/null 2>&1 && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && redis_ok=0
  [ $pg_ok = 1 ] && [ $redis_ok = 1 ] && break
  sleep 0.5
done
exit 0
