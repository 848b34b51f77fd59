#!/usr/bin/env bash
# Build the deployment's images: attnserve:cpu, attnserve-prometheus:bookworm and
# attnserve-haproxy:bookworm (what docker-compose.yml runs); attnserve-build:gguf-ops and
# attnserve-build:serve-venv are the builder stages, kept for their layer cache.
#
# Usage: deploy/images/build.sh            (run by `make images`; needs a Docker daemon:
#                                           `make dockerd` starts one where none runs)
#
# Environment:
#   ATTNSERVE_BASE=auto|local|registry   which base images (default auto):
#       registry  python:3.11-slim-bookworm and debian:bookworm-slim, pulled
#       local     attnserve-base:bookworm, built here with debootstrap from the Debian mirror
#                 apt already uses (root + debootstrap; cached, see below)
#       auto      local when attnserve-base:bookworm exists, else registry when a pull
#                 works, else local
#   ATTNSERVE_CACHE_DIR   where the debootstrapped base tarball is kept, outside any clone,
#                         so that a fresh clone or a fresh data root reuses it
#                         (default /var/cache/attnserve)
#   PYTHON                the interpreter whose pip prepares the wheels (default .venv/bin/python)
#
# The serving image's dependencies are prepared on the host as wheels (deploy/images/wheels/,
# pinned to the versions installed in the host's .venv, fetched with the host's pip
# configuration: index, certificates) and installed in the build with --no-index, so the build
# needs no network and no credentials, and none of that configuration ends up in the image.
# Each step is skipped when its result is already there (base image, base tarball, wheels
# for the same pins); docker's layer cache does the rest.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"

BASE_MODE=${ATTNSERVE_BASE:-auto}
CACHE_DIR=${ATTNSERVE_CACHE_DIR:-/var/cache/attnserve}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
LOCAL_BASE=attnserve-base:bookworm
# Bumped when the local base changes in a way a cached tarball or image must not hide: 2 is
# the root directory 0755 (mktemp -d makes it 0700, and with the vfs storage driver the
# container's / then keeps that mode: the non-root service could not even exec /bin/sh).
BASE_VERSION=2
REGISTRY_PYTHON=python:3.11-slim-bookworm
REGISTRY_DEBIAN=debian:bookworm-slim
WHEELS=deploy/images/wheels
# The classic builder: BuildKit is not there with Debian's dockerd 20.10 + compose v1, and the
# Dockerfiles need nothing from it. Builds use the host's network (`--network host`), so they
# work on a daemon without a default bridge too (the compose e2e test runs one).
export DOCKER_BUILDKIT=0

log() { printf '[images %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

docker info >/dev/null 2>&1 \
    || die "no Docker daemon answers${DOCKER_HOST:+ at $DOCKER_HOST}; start one (make dockerd)"

has_image() { docker image inspect "$1" >/dev/null 2>&1; }

# The mirror of `Suites: <suite>` (deb822) or `deb <uri> <suite>` (one-line) in apt's sources.
apt_mirror() {
    local suite=$1 fallback=$2 uri file files=()
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                /etc/apt/sources.list.d/*.sources; do
        [ -f "$file" ] && files+=("$file")
    done
    [ ${#files[@]} -gt 0 ] || { echo "$fallback"; return; }
    # shellcheck disable=SC2016  # awk's own $n
    uri=$(awk -v suite="$suite" '
        function stanza_end() { if (uris != "" && found) { print uris; exit } uris = ""; found = 0 }
        FNR == 1 || /^[[:space:]]*$/ { stanza_end() }
        /^deb[[:space:]]/ { sub(/\[[^]]*\][[:space:]]*/, ""); if ($3 == suite) { print $2; exit } }
        /^URIs:/ { uris = $2 }
        /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) found = 1 }
        END { stanza_end() }' "${files[@]}" | head -n 1)
    echo "${uri:-$fallback}"
}

# The mode of a tarball's root entry ("drwxr-xr-x"), as `tar -tv` prints it.
root_mode() { tar -tvf "$1" 2>/dev/null | awk 'NR == 1 { print $1; exit }'; }

build_local_base() {
    if has_image "$LOCAL_BASE" && [ "$(docker image inspect -f \
            '{{index .Config.Labels "org.attnserve.base-version"}}' "$LOCAL_BASE")" = "$BASE_VERSION" ]
    then
        log "base $LOCAL_BASE: present"
        return
    fi
    local tarball=$CACHE_DIR/base/bookworm-minbase-python3.tar
    if [ -f "$tarball" ] && [ "$(root_mode "$tarball")" != drwxr-xr-x ]; then
        log "base tarball $tarball: root directory $(root_mode "$tarball"), not 0755: rebuilding"
        rm -f "$tarball"
    fi
    if [ ! -f "$tarball" ]; then
        [ "$(id -u)" -eq 0 ] || die "building the local base needs root (debootstrap)"
        command -v debootstrap >/dev/null || die "debootstrap missing (make system-deps)"
        local mirror security rootfs
        mirror=$(apt_mirror bookworm http://deb.debian.org/debian)
        security=$(apt_mirror bookworm-security http://deb.debian.org/debian-security)
        mkdir -p "$CACHE_DIR/base"
        rootfs=$(mktemp -d "$CACHE_DIR/base/rootfs.XXXXXX")
        chmod 0755 "$rootfs"  # it becomes the image's /: mktemp made it 0700
        # shellcheck disable=SC2064  # expand now: the trap must remove this very directory
        trap "rm -rf '$rootfs'" EXIT
        log "debootstrap bookworm from $mirror into $rootfs (about a minute)"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs" "$mirror" >"$CACHE_DIR/base/debootstrap.log" 2>&1 \
            || die "debootstrap failed: see $CACHE_DIR/base/debootstrap.log"
        cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
        # Security and point-release updates, as a pulled debian image would have them.
        log "apt-get upgrade inside the base"
        chroot "$rootfs" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get -y -qq -o Dpkg::Use-Pty=0 upgrade && apt-get clean' \
            >>"$CACHE_DIR/base/debootstrap.log" 2>&1 \
            || die "apt-get upgrade in the base failed: see $CACHE_DIR/base/debootstrap.log"
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/tmp/*
        tar -C "$rootfs" --numeric-owner -cf "$tarball.partial" .
        [ "$(root_mode "$tarball.partial")" = drwxr-xr-x ] \
            || die "the base tarball's root is $(root_mode "$tarball.partial"), not drwxr-xr-x"
        mv "$tarball.partial" "$tarball"
        rm -rf "$rootfs"
        trap - EXIT
    fi
    log "docker import $tarball -> $LOCAL_BASE"
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        --change "LABEL org.attnserve.base-version=$BASE_VERSION" \
        --message "debootstrap --variant=minbase bookworm + python3, python3-venv" \
        "$tarball" "$LOCAL_BASE" >/dev/null
}

choose_bases() {
    case "$BASE_MODE" in
        registry)
            docker pull -q "$REGISTRY_PYTHON" >/dev/null && docker pull -q "$REGISTRY_DEBIAN" >/dev/null \
                || die "cannot pull $REGISTRY_PYTHON / $REGISTRY_DEBIAN"
            PY_BASE=$REGISTRY_PYTHON DEB_BASE=$REGISTRY_DEBIAN ;;
        local)
            build_local_base
            PY_BASE=$LOCAL_BASE DEB_BASE=$LOCAL_BASE ;;
        auto)
            if has_image "$LOCAL_BASE"; then
                BASE_MODE=local
            elif timeout 60 docker pull -q "$REGISTRY_DEBIAN" >/dev/null 2>&1 \
                    && timeout 300 docker pull -q "$REGISTRY_PYTHON" >/dev/null 2>&1; then
                BASE_MODE=registry
            else
                log "no image registry answers: building a local Debian base"
                BASE_MODE=local
            fi
            choose_bases ;;
        *) die "ATTNSERVE_BASE must be auto, local or registry, not $BASE_MODE" ;;
    esac
}

# Wheels of the serve extra for the base's Python, pinned to the host .venv's versions.
prepare_wheels() {
    [ -x "$PYTHON" ] || die "$PYTHON missing (make venv, or set PYTHON=)"
    local host_py base_py key
    host_py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    base_py=$(docker run --rm --network none --entrypoint python3 "$PY_BASE" \
                  -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$host_py" != "$base_py" ]; then
        rm -f "$WHEELS"/*.whl "$WHEELS/.key"
        [ "$BASE_MODE" = registry ] \
            || die "$PYTHON is Python $host_py, the base $PY_BASE has $base_py: wheels would not fit"
        log "wheels: none ($PYTHON is Python $host_py, the base has $base_py): pip in the build uses the index"
        return
    fi
    local work
    work=$(mktemp -d)
    "$PYTHON" - "$work/requirements.txt" <<'EOF'
import sys, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve"]
# setuptools and wheel: the build backend, for `pip install .` with --no-index in the image.
open(sys.argv[1], "w").write("\n".join([*extra, "setuptools>=68", "wheel"]) + "\n")
EOF
    # Pins: what the tests ran with here. Direct references cannot be constraints.
    "$PYTHON" -m pip freeze --exclude-editable | grep -v ' @ ' >"$work/constraints.txt" || true
    key=$(cat "$work/requirements.txt" "$work/constraints.txt" <(echo "$base_py $(uname -m)") \
          | sha256sum | cut -d' ' -f1)
    if [ -f "$WHEELS/.key" ] && [ "$(cat "$WHEELS/.key")" = "$key" ] \
            && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        log "wheels: up to date ($(ls "$WHEELS"/*.whl | wc -l) in $WHEELS)"
    else
        log "wheels: pip wheel the serve extra into $WHEELS"
        rm -f "$WHEELS"/*.whl "$WHEELS/.key"
        # (pip warns once per package about index locations of the host that do not exist)
        "$PYTHON" -m pip wheel --quiet --wheel-dir "$WHEELS" -r "$work/requirements.txt" \
            -c "$work/constraints.txt" 2> >(grep -v 'is neither a file nor a directory' >&2)
        echo "$key" >"$WHEELS/.key"
    fi
    rm -rf "$work"
}

# The GGUF op library's inputs for the image's gguf-ops stage: ONNX Runtime's headers
# (Debian trixie's libonnxruntime-dev, unpacked) and the pinned llama-cpp-python sdist, fetched
# into the host's .cache/ by service/ops/build.py's own functions (the host's apt mirror and
# pip configuration; once), copied into deploy/images/gguf-ops/ in .cache/'s layout. Where
# the host cannot fetch them the directory stays empty and the stage fetches them itself.
prepare_gguf_ops_inputs() {
    local dir=deploy/images/gguf-ops paths include tarball stem errors
    errors=$(mktemp)
    if ! paths=$("$PYTHON" -c 'from service.ops import build as b
print(b.ensure_ort_headers()); print(b.ensure_sdist())' 2>"$errors"); then
        log "gguf-ops inputs: the host could not fetch them ($(tail -n 1 "$errors")): the build fetches them"
        rm -rf "$dir/ort-headers" "$dir/llamacpp-tools" "$errors"
        return
    fi
    rm -f "$errors"
    include=$(sed -n 1p <<<"$paths") tarball=$(sed -n 2p <<<"$paths")
    stem=$(basename "$(dirname "$(dirname "$(dirname "$include")")")")
    rm -rf "$dir/ort-headers" "$dir/llamacpp-tools"
    mkdir -p "$dir/ort-headers/$stem/usr/include" "$dir/llamacpp-tools"
    cp -a "$include" "$dir/ort-headers/$stem/usr/include/"
    ln -f "$tarball" "$dir/llamacpp-tools/" 2>/dev/null || cp -f "$tarball" "$dir/llamacpp-tools/"
    log "gguf-ops inputs: $stem headers and $(basename "$tarball") in $dir"
}

build() {
    local tag=$1; shift
    local started=$SECONDS
    # (docker >= 23 warns that the classic builder is deprecated: that is known, drop it)
    docker build --network host --quiet --tag "$tag" "$@" >/dev/null \
        2> >(grep -v -e 'legacy builder is deprecated' -e 'BuildKit is currently disabled' \
                     -e 'environment-variable\.$' -e '^$' >&2)
    log "built $tag in $((SECONDS - started)) s: $(docker image inspect -f '{{.Size}}' "$tag" \
        | awk '{printf "%.0f MB", $1 / 1e6}')"
}

choose_bases
log "bases: $PY_BASE (attnserve), $DEB_BASE (prometheus, haproxy)"
prepare_wheels
prepare_gguf_ops_inputs
# The builder stages get tags of their own: untagged, the prune below would drop them, and
# with them the layer cache that keeps the dependency install and ggml's compile (about
# 1.5 min on 2 cores) from running again on every build.
build attnserve-build:gguf-ops --file deploy/Dockerfile --build-arg "BASE_IMAGE=$PY_BASE" \
    --target gguf-ops .
build attnserve-build:serve-venv --file deploy/Dockerfile --build-arg "BASE_IMAGE=$PY_BASE" \
    --target serve-venv .
build attnserve:cpu --file deploy/Dockerfile --build-arg "BASE_IMAGE=$PY_BASE" .
build attnserve-prometheus:bookworm --build-arg "BASE_IMAGE=$DEB_BASE" deploy/images/prometheus
build attnserve-haproxy:bookworm --build-arg "BASE_IMAGE=$DEB_BASE" deploy/images/haproxy
# Earlier builds of these tags are now untagged: drop them so the data root does not grow.
docker image prune --force >/dev/null
