"""service.ray_app.build_app's placement arguments, read back from the application Serve is
handed (no cluster): the router's custom resources keep it on the nodes that declare them.

Skipped with its reason where Ray is not installed (``pip install .[ray]``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="Ray is not installed: pip install .[ray]")

from service.ray_app import ROUTER_NAME, build_app


def deployment_of(app: object) -> object:
    # Serve's Application keeps its ingress deployment here (ray 2.x; pinned <3).
    return app._bound_deployment  # type: ignore[attr-defined]


def test_the_router_asks_for_the_resources_given_and_no_cpu() -> None:
    app = build_app({"serve": {"model": "m"}, "router_resources": {"ingress": 0.01}})
    router = deployment_of(app)
    assert router.name == ROUTER_NAME  # type: ignore[attr-defined]
    assert router.ray_actor_options == {  # type: ignore[attr-defined]
        "num_cpus": 0, "resources": {"ingress": 0.01}}


def test_without_resources_the_router_may_run_anywhere() -> None:
    router = deployment_of(build_app({"serve": {"model": "m"}}))
    assert router.ray_actor_options["resources"] == {}  # type: ignore[attr-defined]


def test_header_routing_has_no_router() -> None:
    app = build_app({"serve": {"model": "m"}, "adapter_routing": "header",
                     "router_resources": {"ingress": 0.01}})
    assert deployment_of(app).name == "attnserve"  # type: ignore[attr-defined]
