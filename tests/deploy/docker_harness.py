"""A Docker daemon of the tests' own, docker-compose driven against it, bounded HTTP calls.

Used by test_compose_e2e.py and test_compose_scale.py through the fixtures in conftest.py.
The daemon listens on a socket in a fresh temporary exec root, so it never meets the
machine's own daemon or a user's containers; its data root is a cache directory outside the
clone (ATTNSERVE_CACHE_DIR, default /var/cache/attnserve), one per storage driver (dockerd's
own choice, and vfs, where an image's file modes are applied as they are: overlay2 hid a
base whose / was 0700), so the images are built once per machine and driver and later runs
only check them. It runs without a default bridge and with its own
address pool, so it can run beside another daemon; builds use the host network
(deploy/images/build.sh) and compose makes its own networks. Every wait here has a timeout.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("ATTNSERVE_CACHE_DIR", "/var/cache/attnserve"))
DATA_ROOT = CACHE_DIR / "e2e-docker"  # dockerd's default driver; vfs: e2e-docker-vfs
BASE_TARBALL = CACHE_DIR / "base" / "bookworm-minbase-python3.tar"
# Far from docker's defaults (172.17+/16, 192.168/20) and from a user daemon's networks.
ADDRESS_POOL = "base=10.213.0.0/16,size=24"
# What docker-compose.yml and docker read from the environment: the tests set their own.
COMPOSE_VARIABLES = ("ATTNSERVE_", "DOCKER_", "COMPOSE_", "PUBLISH_ADDRESS", "PROMETHEUS_",
                     "PROXY_", "GRAFANA_")
T = TypeVar("T")
# dockerd's own choice (overlay2 where the kernel allows it), and vfs: what
# deploy/images/dockerd.sh falls back to where overlay is unavailable, and the driver that
# applies every file mode of an image as it is (overlay2 hid a base whose / was 0700).
STORAGE_DRIVERS = (None, "vfs")


def tool(name: str) -> str | None:
    """`name` on PATH, or in the sbin directories a non-login root shell may lack."""
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin", "/usr/local/sbin") if (p := Path(d) / name)
         .is_file()), None)


def unavailable_reason() -> str | None:
    """Why the compose end-to-end tests cannot run here, or None when they can."""
    if os.environ.get("ATTNSERVE_SKIP_DOCKER_E2E"):
        return "ATTNSERVE_SKIP_DOCKER_E2E is set"
    if os.geteuid() != 0:
        return "not root: the tests start their own dockerd, which needs root"
    missing = [t for t in ("dockerd", "docker", "docker-compose") if tool(t) is None]
    if not BASE_TARBALL.is_file() and tool("debootstrap") is None:
        missing.append("debootstrap")
    if missing:
        return (f"{', '.join(missing)} not installed (make system-deps installs docker.io, "
                f"docker-compose and debootstrap as root with apt-get)")
    return None


def wait_for(probe: Callable[[], T | None], timeout: float, what: str,
             interval: float = 0.5) -> T:
    """Call `probe` until it returns non-None; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = probe()
            if value is not None:
                return value
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}"
                               + (f" (last error: {last})" if last else ""))
        time.sleep(interval)


# ---------------------------------------------------------------------------------- daemon


def data_root(storage_driver: str | None) -> Path:
    """The daemon's data root: images and layers are per storage driver."""
    return DATA_ROOT if storage_driver is None else DATA_ROOT.with_name(
        f"{DATA_ROOT.name}-{storage_driver}")


@dataclass
class Daemon:
    exec_root: Path
    proc: subprocess.Popen[bytes]
    log: Path
    lock: Any  # the open lock file: one daemon on the data root at a time
    data_root: Path

    @property
    def storage_driver(self) -> str:
        return self.docker("info", "-f", "{{.Driver}}").stdout.strip()

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(COMPOSE_VARIABLES)}
        env.update(DOCKER_HOST=f"unix://{self.exec_root}/docker.sock", DOCKER_BUILDKIT="0")
        return env

    def docker(self, *args: str, timeout: float = 60, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        docker = tool("docker")
        assert docker is not None
        proc = subprocess.run([docker, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-2000:]}")
        return proc

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def remove_everything(self) -> None:
        """Containers, networks and volumes of this daemon (all ours); images stay cached."""
        ids = self.docker("ps", "-aq").stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, timeout=120)
        self.docker("network", "prune", "-f")
        self.docker("volume", "prune", "-f")


def take_data_root(root: Path, timeout: float) -> Any:
    """An exclusive lock on the data root: a second test session waits for the first."""
    root.mkdir(parents=True, exist_ok=True)
    lock = root.with_name(f"{root.name}.lock").open("w")

    def taken() -> bool | None:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        return True

    try:
        wait_for(taken, timeout, f"another test session to release {root}", interval=2)
    except BaseException:
        lock.close()
        raise
    return lock


def stale_daemons(root: Path) -> str:
    """Processes still using the data root (a dockerd or containerd of a killed run)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and any(
                    re.search(rf"{re.escape(str(root))}(/|$)", arg)
                    for arg in (proc / "cmdline").read_text().split("\0")):
                found.append(f"{proc.name}: {(proc / 'cmdline').read_text()[:120]!r}")
        except OSError:
            continue
    return "; ".join(found)


def start_daemon(storage_driver: str | None = None, timeout: float = 90) -> Daemon:
    """A daemon on the data root of ``storage_driver`` (None: dockerd's own choice)."""
    dockerd = tool("dockerd")
    assert dockerd is not None
    root = data_root(storage_driver)
    lock = take_data_root(root, timeout=900)
    # Short path: containerd's socket lives under it and sockets have a ~108-byte limit.
    exec_root = Path(tempfile.mkdtemp(prefix="attnserve-dockerd-", dir="/tmp"))
    log = exec_root / "dockerd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [dockerd, f"--data-root={root}", f"--exec-root={exec_root}",
             *([f"--storage-driver={storage_driver}"] if storage_driver else []),
             f"--host=unix://{exec_root}/docker.sock", f"--pidfile={exec_root}/docker.pid",
             "--bridge=none", f"--default-address-pool={ADDRESS_POOL}", "--log-level=warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # a Ctrl-C of pytest does not reach it half-way
    daemon = Daemon(exec_root, proc, log, lock, root)

    def answers() -> bool | None:
        if proc.poll() is not None:
            raise RuntimeError(f"dockerd exited with {proc.returncode}:\n{daemon.log_tail()}\n"
                               f"processes on {root}: {stale_daemons(root) or 'none'}")
        return True if daemon.docker("info", check=False, timeout=10).returncode == 0 else None

    try:
        wait_for(answers, timeout, "dockerd to answer")
        daemon.remove_everything()  # what a killed earlier run may have left in the data root
    except BaseException:
        stop_daemon(daemon)
        raise
    return daemon


def stop_daemon(daemon: Daemon) -> None:
    """Remove our containers, stop dockerd (SIGTERM, SIGKILL after 30 s), drop the exec root."""
    try:
        if daemon.proc.poll() is None:
            daemon.remove_everything()
    except (RuntimeError, subprocess.SubprocessError):
        pass  # the daemon is going away regardless; its data root is ours to reuse
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGTERM)
            try:
                daemon.proc.wait(30)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
                daemon.proc.wait(10)
        unmount_under(daemon.exec_root)
        shutil.rmtree(daemon.exec_root, ignore_errors=True)
        daemon.lock.close()  # releases the flock


# What deploy/images/build.sh builds and docker-compose.yml runs.
DEPLOY_IMAGES = ("attnserve:cpu", "attnserve-prometheus:bookworm", "attnserve-haproxy:bookworm")


def image_ids(daemon: Daemon, images: tuple[str, ...] = DEPLOY_IMAGES) -> list[str | None]:
    """Each image's id on ``daemon`` (None where it has none)."""
    ids: list[str | None] = []
    for image in images:
        proc = daemon.docker("image", "inspect", "-f", "{{.Id}}", image, check=False)
        ids.append(proc.stdout.strip() if proc.returncode == 0 else None)
    return ids


def transfer_images(source: Daemon, target: Daemon, images: tuple[str, ...] = DEPLOY_IMAGES,
                    timeout: float = 900) -> bool:
    """`docker save | docker load` the images from ``source`` to ``target`` unless the target
    has them with the same ids already (what a user does who builds on one host and runs on
    another); whether anything moved."""
    if image_ids(source, images) == image_ids(target, images):
        return False
    docker = tool("docker")
    assert docker is not None
    save = subprocess.Popen([docker, "save", *images], env=source.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert save.stdout is not None
    try:
        load = subprocess.run([docker, "load", "--quiet"], env=target.env, stdin=save.stdout,
                              capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        save.stdout.close()
        saved = save.wait(timeout)
    if saved != 0 or load.returncode != 0:
        raise RuntimeError(f"docker save | docker load failed ({saved}, {load.returncode}):\n"
                           f"{load.stderr[-2000:]}")
    return True


def unmount_under(root: Path) -> None:
    """What dockerd leaves mounted in its exec root (netns/default), deepest first."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", point], capture_output=True, timeout=30, check=False)


# ---------------------------------------------------------------------------------- compose


def free_port_range(n: int) -> int:
    """The first of `n` consecutive loopback ports that are free right now."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + n > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + n):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


# What docker says when a host port it publishes is taken (docker-proxy, or the kernel).
PORT_TAKEN = re.compile(r"port is already allocated|address already in use", re.IGNORECASE)
UP_ATTEMPTS = 4


@dataclass
class Compose:
    """docker-compose on the repository's docker-compose.yml, as project `project`.

    ``ports`` picks the host ports (settings docker-compose.yml reads) when the project is
    made, and again whenever ``up`` finds one taken: they are free when probed, but docker
    publishes them only later, and a stopped stack gives them back in between.
    """

    daemon: Daemon
    project: str
    settings: dict[str, str]  # the variables docker-compose.yml reads (ports, model dir)
    profiles: tuple[str, ...] = ()
    transcript: list[str] = field(default_factory=list)
    ports: Callable[[], dict[str, str]] | None = None

    def __post_init__(self) -> None:
        if self.ports is not None:
            self.settings.update(self.ports())

    def up(self, *args: str, timeout: float = 300) -> None:
        """`docker-compose up ARGS`; on new host ports again (up to UP_ATTEMPTS in all) when
        one was taken since it was probed."""
        for attempt in range(1, UP_ATTEMPTS + 1):
            proc = self.run("up", *args, timeout=timeout, check=False)
            if proc.returncode == 0:
                return
            taken = self.ports is not None and PORT_TAKEN.search(proc.stderr) is not None
            if not taken or attempt == UP_ATTEMPTS:
                raise RuntimeError(f"docker-compose up {' '.join(args)} failed (attempt "
                                   f"{attempt}):\n{proc.stderr[-3000:]}")
            assert self.ports is not None
            fresh = self.ports()
            self.settings.update(fresh)
            self.transcript.append(f"a host port was taken: up again on {fresh}")

    def run(self, *args: str, timeout: float = 180, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        compose = tool("docker-compose")
        assert compose is not None
        profile_args = [a for p in self.profiles for a in ("--profile", p)]
        cmd = [compose, "-f", str(REPO / "docker-compose.yml"), "-p", self.project,
               *profile_args, *args]
        started = time.monotonic()
        proc = subprocess.run(cmd, env={**self.daemon.env, **self.settings}, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, check=False)
        self.transcript.append(f"docker-compose {' '.join(args)}: rc {proc.returncode} in "
                               f"{time.monotonic() - started:.1f} s")
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        return proc

    def containers(self, service: str) -> list[str]:
        return self.run("ps", "-q", service, timeout=30).stdout.split()

    def inspect(self, container: str) -> dict[str, Any]:
        return json.loads(self.daemon.docker("inspect", container).stdout)[0]

    def wait_healthy(self, service: str, replicas: int, timeout: float) -> list[str]:
        def healthy() -> list[str] | None:
            ids = self.containers(service)
            states = [self.inspect(c)["State"] for c in ids]
            for state in states:
                if state["Status"] in ("exited", "dead"):
                    raise RuntimeError(f"{service} exited: {state}\n{self.logs(service)}")
            ok = [c for c, state in zip(ids, states, strict=True)
                  if state.get("Health", {}).get("Status") == "healthy"]
            return ok if len(ok) == replicas else None

        return wait_for(healthy, timeout, f"{replicas} healthy {service} container(s)",
                        interval=1.0)

    def host_port(self, container: str, port: int = 8000) -> int:
        binding = self.inspect(container)["NetworkSettings"]["Ports"][f"{port}/tcp"][0]
        return int(binding["HostPort"])

    def logs(self, service: str = "", tail: int = 60) -> str:
        args = ["logs", "--no-color", f"--tail={tail}"] + ([service] if service else [])
        return self.run(*args, timeout=60, check=False).stdout

    def down(self) -> None:
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180,
                 check=False)


# ---------------------------------------------------------------------------------- HTTP

CHAT_MODEL = "smollm2-135m-instruct"  # the artifact's model_name: the served name


def chat_body(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def post_json(url: str, body: dict[str, Any], timeout: float = 60
              ) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a JSON POST, header names lower-cased (HTTP/1.1 and
    HAProxy do not keep their case); never raises on 4xx/5xx."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, lower(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, lower(err.headers), err.read()


def lower(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


@dataclass
class Stream:
    """An OpenAI chat stream read on a thread; `first_chunk` is set when tokens flow."""

    url: str
    body: dict[str, Any]
    timeout: float = 90
    first_chunk: threading.Event = field(default_factory=threading.Event)
    events: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        request = urllib.request.Request(self.url, data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                for line in response:
                    text = line.decode().strip()
                    if not text.startswith("data:"):
                        continue
                    payload = text[len("data:"):].strip()
                    self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    self.first_chunk.set()
        except BaseException as exc:  # reported by join(), on the test's thread
            self.error = exc
        finally:
            self.first_chunk.set()

    def join(self, timeout: float) -> list[Any]:
        assert self.thread is not None
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"stream still open after {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.events
