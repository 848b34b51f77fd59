#!/usr/bin/env bash
# Start (or stop) a Docker daemon on a machine where no service manager runs one: CI VMs,
# containers, the sandboxes this project is developed on. Debian's docker.io (dockerd 20.10).
#
# Usage: deploy/images/dockerd.sh start     (run by `make dockerd`)
#        deploy/images/dockerd.sh stop
#        deploy/images/dockerd.sh status
#
# `start` does nothing when a daemon already answers (DOCKER_HOST, or the default socket);
# with systemd it runs `systemctl start docker`; otherwise it starts dockerd in the
# background on the default socket /var/run/docker.sock, with its default data root
# /var/lib/docker, so that plain `docker` and `docker-compose` find it. The storage driver is
# dockerd's own choice (overlay2 where the kernel allows it, else vfs); set
# ATTNSERVE_DOCKER_STORAGE_DRIVER to force one. Log: /var/log/attnserve-dockerd.log.
set -euo pipefail

PIDFILE=/var/run/attnserve-dockerd.pid
LOG=/var/log/attnserve-dockerd.log
WAIT_S=60

answers() { docker info >/dev/null 2>&1; }

case "${1:-}" in
    start)
        if answers; then
            echo "dockerd: a daemon already answers${DOCKER_HOST:+ at $DOCKER_HOST}"
            exit 0
        fi
        [ "$(id -u)" -eq 0 ] || { echo "dockerd: needs root" >&2; exit 1; }
        command -v dockerd >/dev/null \
            || { echo "dockerd: not installed (make system-deps installs docker.io)" >&2; exit 1; }
        if [ -d /run/systemd/system ]; then
            systemctl start docker
        else
            args=(--pidfile "$PIDFILE")
            if [ -n "${ATTNSERVE_DOCKER_STORAGE_DRIVER:-}" ]; then
                args+=(--storage-driver "$ATTNSERVE_DOCKER_STORAGE_DRIVER")
            fi
            # setsid: the daemon outlives this shell and make's process group.
            setsid dockerd "${args[@]}" </dev/null >>"$LOG" 2>&1 &
        fi
        for _ in $(seq "$WAIT_S"); do
            if answers; then
                echo "dockerd: running ($(docker info -f '{{.Driver}}') storage; log $LOG)"
                exit 0
            fi
            sleep 1
        done
        echo "dockerd: no answer after ${WAIT_S} s; see $LOG" >&2
        exit 1 ;;
    stop)
        if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            pid=$(cat "$PIDFILE")
            kill -TERM "$pid"
            for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done
            echo "dockerd: pid $pid still running after 30 s" >&2
            exit 1
        fi
        echo "dockerd: none started by this script is running" ;;
    status)
        if answers; then docker info -f 'dockerd {{.ServerVersion}}, {{.Driver}} storage, {{.Containers}} containers'
        else echo "dockerd: no daemon answers"; exit 1; fi ;;
    *)
        sed -n '2,14p' "$0" >&2
        exit 2 ;;
esac
