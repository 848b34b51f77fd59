"""Error bodies from the handlers alone (no server): even an unforeseen bug answers JSON."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.http.errors import install_error_handlers


def test_an_unhandled_exception_is_a_json_500_in_the_route_shape() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/generate")
    @app.post("/v1/completions")
    async def broken() -> None:
        raise RuntimeError("boom")

    client = TestClient(app, raise_server_exceptions=False)
    tgi = client.post("/generate")
    assert tgi.status_code == 500
    assert tgi.json() == {"error": "internal error: RuntimeError", "error_type": "internal"}
    v1 = client.post("/v1/completions")
    assert v1.status_code == 500
    assert v1.json()["error"]["message"] == "internal error: RuntimeError"
    assert v1.json()["error"]["code"] == "internal_error"
