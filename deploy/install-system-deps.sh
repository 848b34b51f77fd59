#!/usr/bin/env bash
# Install the system tools the deploy checks need: prometheus + promtool (Debian package
# `prometheus`), docker-compose (Debian package `docker-compose`, v1, which parses the
# compose file offline), dockerd (`docker.io`, which runs the compose stack end to end) and
# debootstrap (builds the local Debian base image where no registry answers); and the
# headless browser the /viz tests drive through Playwright
# (Debian package `chromium`, /usr/bin/chromium; Playwright's own browser download is not
# used).
#
# With --build-tools it installs instead the compilers that build the GgufMatMul custom op
# (service/ops/build.py): cmake, ninja (Debian package `ninja-build`) and g++.
#
# Usage: deploy/install-system-deps.sh        (run by `make system-deps`, which `make test` runs)
#        deploy/install-system-deps.sh --build-tools       (run by `make gguf-ops`)
#
# Idempotent: does nothing when the tools are already on PATH. Where they are missing and we
# cannot install them (not root, or no apt-get) it prints a loud message and exits 0: the
# deploy tests then skip with the same message instead of failing the whole suite.
set -euo pipefail

if [ "${1:-}" = "--build-tools" ]; then
    tools=(cmake ninja g++)
    consequence="the GgufMatMul op (service/ops) cannot be built and its tests will SKIP"
else
    tools=(promtool prometheus docker-compose dockerd debootstrap chromium)
    consequence="the deploy smoke/config tests and the /viz browser tests will SKIP"
fi

missing=()
packages=()
for tool in "${tools[@]}"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        missing+=("$tool")
        case "$tool" in
            promtool) ;;  # comes with the prometheus package
            dockerd) packages+=(docker.io) ;;
            ninja) packages+=(ninja-build) ;;
            *) packages+=("$tool") ;;
        esac
    fi
done
if [[ " ${missing[*]} " == *" promtool "* && " ${packages[*]} " != *" prometheus "* ]]; then
    packages+=(prometheus)
fi
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
        "Debian/Ubuntu packages ${packages[*]} yourself, or ${consequence}."
    exit 0
fi

echo "install-system-deps: installing ${packages[*]} (missing: ${missing[*]})" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${packages[@]}"; }
then
    banner "apt-get could not install ${packages[*]} (offline?); ${consequence}."
    exit 0
fi
