"""A local multi-node Ray cluster serving service/ray_app.py, for the Ray tests: nodes as
separate raylets on this machine (``ray.cluster_utils.Cluster``), Serve's one proxy on the
head node on a free loopback port. Skips the test with its reason where Ray cannot start."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

# With one proxy for several nodes, Serve would send every request to the replica on the
# proxy's own node while that one has room (its default, right where every node runs a
# proxy, as deploy/ray/serve.yaml does).
LOCAL_PREFERENCE = "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"


@dataclass
class LocalCluster:
    url: str  # the proxy
    cluster: Any  # ray.cluster_utils.Cluster
    workers: list[Any]  # the nodes added to the head, in order


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 240.0) -> None:
    """Until ``condition()`` holds (bounded): the cluster's state (replicas placed, engines
    loaded) is Ray's and Serve's, which signal nothing a test could wait on, only report it
    when asked."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving_on_ray(app_args: dict[str, Any], head_cpus: float, worker_cpus: list[float]
                   ) -> Iterator[LocalCluster]:
    """service.ray_app.build_app(app_args) deployed as application "attnserve" at "/"."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from service.ray_app import build_app

    os.environ[LOCAL_PREFERENCE] = "0"
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
        workers = [cluster.add_node(num_cpus=cpus) for cpus in worker_cpus]
        ray.init(address=cluster.address, include_dashboard=False)
    except Exception as exc:  # no shared memory, no ports: this machine cannot run Ray
        os.environ.pop(LOCAL_PREFERENCE, None)
        pytest.skip(f"Ray cannot start a local cluster here: {type(exc).__name__}: {exc}")
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="attnserve", route_prefix="/", blocking=False)
        yield LocalCluster(f"http://127.0.0.1:{port}", cluster, workers)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop(LOCAL_PREFERENCE, None)
