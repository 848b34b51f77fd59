#!/usr/bin/env bash
# Install the system tools the deploy checks need: prometheus + promtool (Debian package
# `prometheus`) and docker-compose (Debian package `docker-compose`, v1, which parses the
# compose file offline).
#
# Usage: deploy/install-system-deps.sh        (run by `make system-deps`, which `make test` runs)
#
# Idempotent: does nothing when the tools are already on PATH. Where they are missing and we
# cannot install them (not root, or no apt-get) it prints a loud message and exits 0: the
# deploy tests then skip with the same message instead of failing the whole suite.
set -euo pipefail

missing=()
for tool in promtool prometheus docker-compose; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

banner() {
    echo "################################################################################" >&2
    echo "# install-system-deps: $*" >&2
    echo "################################################################################" >&2
}

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    banner "missing ${missing[*]}; not root with apt-get, so not installing. Install the" \
        "Debian/Ubuntu packages 'prometheus' and 'docker-compose' yourself, or the deploy" \
        "smoke/config tests will SKIP."
    exit 0
fi

echo "install-system-deps: installing prometheus docker-compose (missing: ${missing[*]})" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        prometheus docker-compose; }; then
    banner "apt-get could not install prometheus/docker-compose (offline?); the deploy" \
        "smoke/config tests will SKIP."
    exit 0
fi
