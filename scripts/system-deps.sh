#!/usr/bin/env bash
# System packages the tests use: Debian's chromium (Playwright drives it; never `playwright install`),
# iproute2/iptables for the network-namespace testbed, a C compiler for the stand-in NVML, and caddy to validate and
# run docker/Caddyfile (tests/server/test_docker.py) and to front the production smoke stack (scripts/prod-smoke.sh,
# which also uses util-linux's unshare, setpriv and nsenter and passwd's useradd: part of every Debian base).
# Installs only what is missing, and only as root; elsewhere the tests that need them skip with the reason.
set -u
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v cc >/dev/null 2>&1 || need+=(gcc)
dpkg -s libnetfilter-queue-dev >/dev/null 2>&1 || need+=(libnetfilter-queue-dev)
command -v caddy >/dev/null 2>&1 || need+=(caddy)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
      || echo "!! apt-get install failed: ${need[*]}"
    # Debian's package enables a caddy service on :80; the tests only need the binary.
    if [[ " ${need[*]} " == *" caddy "* ]] && command -v systemctl >/dev/null 2>&1; then
      systemctl disable --now caddy.service >/dev/null 2>&1 || true
    fi
  else
    echo "!! missing system packages (install them as root): ${need[*]}"
  fi
fi
exit 0
