"""`docker-compose up` for real: the images built here, SmolLM2 mounted, Prometheus scraping.

What a user runs (docs/containers.md): `make images`, `make deploy-model`, `docker-compose up
-d`; here against a dockerd the tests start themselves (tests/deploy/docker_harness.py), on
free loopback ports. The stack is the default one: attnserve + Prometheus on a compose
network. The tests share one stack per storage driver and pass in any order: the drain and
restart tests stop it, and each test starts from a stack that is up and healthy, except the
restart test, which starts from one whose attnserve is stopped (as the drain test leaves it).

Skipped, loudly, where no dockerd can run (not root, docker.io not installed). The first run
on a machine builds the local Debian base (debootstrap, about two minutes) and the images;
later runs find them in the daemon's data root and only check them (seconds).
"""

from __future__ import annotations

import json
import math
import subprocess
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.docker_harness import (
    BASE_TARBALL,
    CHAT_MODEL,
    DEPLOY_IMAGES,
    STORAGE_DRIVERS,
    Compose,
    Stream,
    chat_body,
    free_port_range,
    post_json,
    wait_for,
)

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(1800),
    # every test once on dockerd's default storage driver and once on vfs
    pytest.mark.parametrize("docker_daemon", [
        pytest.param(d, id=d or "default-driver") for d in STORAGE_DRIVERS],
        indirect=True, scope="module"),
]
START_S = 180.0  # container created → healthy (model load + warm-up: ~10 s when idle)
RUNTIME_UID = 10001
# Image ids whose contents the torch-free probe passed on, this session. The vfs daemon holds
# the very images built on the default one (`docker save | docker load` keeps the ids), so
# what is in them is probed once; what each storage driver makes of them (the / mode, a
# non-root shell) is checked on each by the non-root test below.
PROBED: set[str] = set()


@dataclass
class Stack:
    compose: Compose
    url: str  # attnserve through its published port
    prometheus: str


@pytest.fixture(scope="module")
def running_stack(docker_daemon, deploy_images, deploy_model) -> Iterator[Compose]:
    """The compose project, made once per module (and storage driver)."""

    def ports() -> dict[str, str]:
        first = free_port_range(3)
        return {"ATTNSERVE_HOST_PORTS": f"{first}-{first + 2}",
                "PROMETHEUS_HOST_PORT": str(free_port_range(1))}

    compose = Compose(docker_daemon, "attnserve-e2e",
                      {"ATTNSERVE_MODEL_DIR": str(deploy_model)}, ports=ports)
    compose.down()
    try:
        yield compose
    finally:
        print("\n".join(compose.transcript))
        print(compose.logs())
        compose.down()


@pytest.fixture
def stack(running_stack: Compose) -> Stack:
    """The stack up and healthy before each test, whatever the tests before it did (the
    drain and restart tests stop it), so the tests pass in any order. `up -d` on a running
    stack changes nothing: it only starts what is stopped."""
    compose = running_stack
    compose.up("-d", "--no-build", timeout=300)
    (container,) = compose.wait_healthy("attnserve", 1, START_S)
    return Stack(compose, f"http://127.0.0.1:{compose.host_port(container)}",
                 f"http://127.0.0.1:{compose.settings['PROMETHEUS_HOST_PORT']}")


def test_serving_image_is_torch_free_non_root_and_carries_no_host_config(
        docker_daemon, deploy_images) -> None:
    image = json.loads(docker_daemon.docker("image", "inspect", "attnserve:cpu").stdout)[0]
    config = image["Config"]
    assert config["User"] == f"{RUNTIME_UID}:{RUNTIME_UID}"
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert not [e for e in config["Env"] if e.startswith(("PIP_", "REQUESTS_CA", "SSL_CERT"))]
    size_mb = image["Size"] / 1e6
    print(f"attnserve:cpu is {size_mb:.0f} MB; images ready in {deploy_images['seconds']:.0f} s")
    assert size_mb < 700, "torch alone would add ~750 MB"
    if image["Id"] in PROBED:
        return  # these very bytes passed the probe on the other driver's daemon
    probe = ("import importlib.util as u, os, sys; import onnxruntime, service.http.app; "
             "assert u.find_spec('torch') is None, 'torch is installed'; "
             "assert not any(os.path.exists(p) for p in ('/wheels', '/etc/pip.conf', "
             "'/etc/xdg/pip/pip.conf')), 'build inputs left in the image'; print(os.getuid())")
    run = docker_daemon.docker("run", "--rm", "--network", "none", "attnserve:cpu",
                               "python", "-c", probe, timeout=120)
    assert run.stdout.strip() == str(RUNTIME_UID)
    PROBED.add(image["Id"])


# Run inside attnserve:cpu as its user: the op library the image ships (ATTNSERVE_GGUF_OPS,
# deploy/Dockerfile's gguf-ops stage) registers with ONNX Runtime and computes GgufMatMul
# over Q8_0 blocks as numpy does; with a cpuinfo that lacks AVX2 it is refused, not loaded.
GGUF_OPS_PROBE = r"""
import base64, json, os, sys
from pathlib import Path
import numpy as np, onnxruntime as ort, service.ops as ops
path = ops.library_path()
assert path is not None and str(path) == os.environ["ATTNSERVE_GGUF_OPS"], path
info = json.loads((path.parent / "build-info.json").read_text())
assert "avx2" in info["required_cpu_flags"] and "-DGGML_NATIVE=OFF" in info["cmake_args"]
options = ort.SessionOptions()
options.intra_op_num_threads = 1
assert ops.register(options)
sess = ort.InferenceSession(base64.b64decode(sys.argv[1]), options,
                            providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
n, k = 8, 64
d = rng.uniform(0.01, 0.02, (n, k // 32, 1)).astype(np.float16)
q = rng.integers(-127, 128, (n, k // 32, 32), dtype=np.int8)
w = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=2).reshape(n, -1)
x = rng.standard_normal((3, k)).astype(np.float32)
(y,) = sess.run(None, {"X": x, "W": w})
ref = x @ (d.astype(np.float32) * q).reshape(n, k).T
err = float(np.max(np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)))
assert err < 2e-2, err
fake = Path("/tmp/cpuinfo-no-avx2")
fake.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx\n")
ops.CPUINFO, ops._warned = fake, set()
assert ops.library_path() is None and not ops.register(ort.SessionOptions())
print(f"ok {path} {sorted(info['files'])} {err:.1e}")
"""


def gguf_matmul_model() -> str:
    """X [M, 64] · W (Q8_0 rows, an input) → Y: the one-node graph, base64."""
    import base64

    onnx = pytest.importorskip("onnx")
    node = onnx.helper.make_node("GgufMatMul", ["X", "W"], ["Y"], domain="attnserve.gguf",
                                 ggml_type=8, k=64)
    graph = onnx.helper.make_graph(
        [node], "probe",
        [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, None),
         onnx.helper.make_tensor_value_info("W", onnx.TensorProto.UINT8, None)],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)])
    model = onnx.helper.make_model(graph, opset_imports=[
        onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("attnserve.gguf", 1)])
    return base64.b64encode(model.SerializeToString()).decode()


def test_serving_image_loads_its_portable_gguf_op_library(docker_daemon, deploy_images
                                                           ) -> None:
    run = docker_daemon.docker("run", "--rm", "--network", "none", "attnserve:cpu",
                               "python", "-c", GGUF_OPS_PROBE, gguf_matmul_model(),
                               timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok /opt/attnserve/gguf-ops/libattnserve_gguf_ops.so"), \
        run.stdout
    # no compiler and no build tree came along
    tools = docker_daemon.docker("run", "--rm", "--network", "none", "attnserve:cpu", "sh",
                                 "-c", "command -v gcc g++ cc c++ cmake ninja; ls /build /src",
                                 check=False)
    assert tools.stdout.strip() == "", tools.stdout


def test_local_base_tarball_has_a_world_readable_root(deploy_images) -> None:
    """The debootstrapped base's root entry (the image's /) is 0755, and so is every
    top-level directory a non-root process must traverse: a tarball made from a
    ``mktemp -d`` root is 0700 there, which vfs applies as it is."""
    if not BASE_TARBALL.is_file():
        pytest.skip(f"no local base tarball at {BASE_TARBALL}: the images were built on a "
                    "base pulled from a registry")
    with tarfile.open(BASE_TARBALL) as tar:
        root = tar.next()
        assert root is not None and root.name in (".", "./") and root.isdir()
        assert root.mode & 0o7777 == 0o755, oct(root.mode)
        top = {m.name.removeprefix("./"): m.mode & 0o7777 for m in tar.getmembers()
               if m.isdir() and m.name.removeprefix("./").count("/") == 0}
    for name in ("bin", "etc", "lib", "usr", "usr/bin", "home", "opt", "var"):
        mode = top.get(name)
        if mode is not None:
            assert mode & 0o005 == 0o005, f"/{name} is {oct(mode)}"


@pytest.fixture(scope="module")
def non_root_shells(docker_daemon, deploy_images
                    ) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """image -> `docker create` of a container that runs /bin/sh as a non-root user and prints
    the mode of / and its uid, one per image, made side by side: on vfs each create copies
    the image's whole file system (about 25 s each here), and three at once took about as
    long as one. Each test starts its own; all are removed when the module ends."""

    def create(image: str) -> subprocess.CompletedProcess[str]:
        return docker_daemon.docker("create", "--network", "none", "--user", "65534:65534",
                                    "--entrypoint", "/bin/sh", image, "-c",
                                    "stat -c %a /; id -u", timeout=300, check=False)

    with ThreadPoolExecutor(max_workers=len(DEPLOY_IMAGES)) as pool:
        made = dict(zip(DEPLOY_IMAGES, pool.map(create, DEPLOY_IMAGES), strict=True))
    try:
        yield made
    finally:
        ids = [proc.stdout.strip() for proc in made.values() if proc.returncode == 0]
        if ids:
            docker_daemon.docker("rm", "-f", *ids, timeout=300, check=False)


@pytest.mark.parametrize("image", DEPLOY_IMAGES)
def test_every_image_runs_as_a_non_root_user_on_this_storage_driver(
        docker_daemon, non_root_shells, image: str) -> None:
    """Each image's / is 0755 and a non-root user can exec a shell in it, on this daemon's
    storage driver (the module runs on dockerd's default and on vfs)."""
    created = non_root_shells[image]
    assert created.returncode == 0, (docker_daemon.storage_driver, created.stderr[-2000:])
    run = docker_daemon.docker("start", "-a", created.stdout.strip(), timeout=120,
                               check=False)
    assert run.returncode == 0, (docker_daemon.storage_driver, run.stderr[-2000:])
    assert run.stdout.split() == ["755", "65534"], docker_daemon.storage_driver


def test_service_is_healthy_non_root_with_the_model_mounted_read_only(stack, deploy_model
                                                                       ) -> None:
    (container,) = stack.compose.containers("attnserve")
    info = stack.compose.inspect(container)
    assert info["State"]["Health"]["Status"] == "healthy"
    (mount,) = [m for m in info["Mounts"] if m["Destination"] == "/models/default"]
    assert mount["RW"] is False and Path(mount["Source"]) == deploy_model.resolve()
    # every process of the container (the init and the server) runs as the image's user
    top = stack.compose.daemon.docker("top", container, "-eo", "pid,uid,args").stdout.splitlines()
    processes = [line.split(None, 2)[1:] for line in top[1:]]
    assert any("attnserve serve" in args for _, args in processes), top
    assert {uid for uid, _ in processes} == {str(RUNTIME_UID)}, top


def test_chat_through_the_published_port_is_answered_by_smollm2(stack) -> None:
    status, _, raw = post_json(f"{stack.url}/v1/chat/completions",
                               chat_body("What is the capital of France?", 32), timeout=60)
    assert status == 200, raw[:500]
    reply = json.loads(raw)
    assert reply["model"] == CHAT_MODEL
    assert "Paris" in reply["choices"][0]["message"]["content"], reply


def test_prometheus_in_its_container_scrapes_the_service_by_name(stack, smoke) -> None:
    # deploy/smoke.py is the check users run against their own stack: traffic, a scrape
    # after it, p50 time to first token from the histogram, every dashboard metric exposed.
    summary = smoke.check_deployment(stack.url, stack.prometheus, n_requests=3, timeout=90)
    assert summary["health"] == "up"
    assert math.isfinite(summary["ttft_p50_s"]) and summary["ttft_p50_s"] > 0
    targets = smoke.prometheus_api(stack.prometheus, "targets", state="active")["activeTargets"]
    (target,) = [t for t in targets if t["labels"]["job"] == "attnserve"]
    # found through compose's DNS by the service's name, scraped on the container port
    assert target["discoveredLabels"]["__meta_dns_name"] == "attnserve"
    assert target["scrapeUrl"].endswith(":8000/metrics")
    buckets = smoke.prometheus_api(
        stack.prometheus, "query",
        query="sum by (le) (attnserve_time_to_first_token_seconds_bucket)")["result"]
    assert {b["metric"]["le"] for b in buckets} >= {"+Inf"}
    assert float(next(b for b in buckets if b["metric"]["le"] == "+Inf")["value"][1]) >= 3


def test_compose_stop_drains_an_in_flight_stream(stack) -> None:
    # 96 tokens take a few seconds: well inside the 20 s drain of docker-compose.yml.
    stream = Stream(f"{stack.url}/v1/chat/completions",
                    chat_body("Tell me a story about a lighthouse.", 96, stream=True,
                              ignore_eos=True)).start()
    assert stream.first_chunk.wait(60), "no token within 60 s"
    (container,) = stack.compose.containers("attnserve")
    stack.compose.run("stop", timeout=120)  # SIGTERM to every service, Prometheus first
    events = stream.join(30)
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if "choices" in e]
    assert not [e for e in events[:-1] if "error" in e], events[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) >= 90
    state = stack.compose.inspect(container)["State"]
    assert (state["Status"], state["ExitCode"]) == ("exited", 0)
    logs = stack.compose.daemon.docker("logs", container)
    assert "signal SIGTERM: draining in-flight requests" in logs.stdout + logs.stderr


@pytest.fixture
def stopped_service(running_stack: Compose) -> Compose:
    """The stack made, its attnserve container stopped by `docker-compose stop attnserve`
    and kept (exited, not removed). The drain test before it in this file leaves the whole
    stack stopped that way, so only the stop (a no-op then) runs; in any other order the
    stack is brought up and healthy first, as `stack` does."""
    compose = running_stack
    made = compose.containers("attnserve")
    if len(made) != 1 or compose.inspect(made[0])["State"]["Status"] not in ("running",
                                                                             "exited"):
        compose.up("-d", "--no-build", timeout=300)
        compose.wait_healthy("attnserve", 1, START_S)
    (container,) = compose.containers("attnserve")
    compose.run("stop", "attnserve", timeout=120)
    assert compose.inspect(container)["State"]["Status"] == "exited"
    return compose


def test_restarted_service_serves_again_from_the_same_volume(stopped_service: Compose,
                                                             deploy_model) -> None:
    compose = stopped_service
    (container,) = compose.containers("attnserve")
    compose.run("start", timeout=120)
    (healthy,) = compose.wait_healthy("attnserve", 1, START_S)
    assert healthy == container  # the same container, restarted, not a new one
    (mount,) = [m for m in compose.inspect(container)["Mounts"]
                if m["Destination"] == "/models/default"]
    assert Path(mount["Source"]) == deploy_model.resolve() and mount["RW"] is False
    url = f"http://127.0.0.1:{compose.host_port(container)}"

    def answered() -> dict | None:
        status, _, raw = post_json(f"{url}/v1/chat/completions",
                                   chat_body("What is the capital of France?", 32))
        return json.loads(raw) if status == 200 else None

    reply = wait_for(answered, 60, "a chat answer after the restart")
    assert "Paris" in reply["choices"][0]["message"]["content"]
