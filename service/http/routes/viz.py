"""GET /viz: the attention viewer, a page of our own HTML, JS and CSS (service/static/viz).

The page and its assets are public, like /docs; the data the page shows comes from the
ordinary routes (/info, /generate, /attention), which it calls with the API key the user
types, so those stay protected exactly as for any other client. The page only learns
whether a key is needed (a meta tag), never the key. A Content-Security-Policy pins every
script, style, image and connection to this origin: the browser refuses anything else.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from service.http.deps import RuntimeDep

router = APIRouter(tags=["viz"])

STATIC_PACKAGE = ("service", "static/viz")
STATIC_PATH = "/viz/static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'self'")
AUTH_PLACEHOLDER = "{{AUTH_REQUIRED}}"


@cache
def _page() -> str:
    page = files("service").joinpath("static/viz/index.html").read_text("utf-8")
    assert AUTH_PLACEHOLDER in page, "index.html lost its auth placeholder"
    return page


@router.get("/viz", response_class=HTMLResponse,
            summary="Attention viewer: head view, model view, step-by-step view")
async def viz(runtime: RuntimeDep) -> Response:
    auth = "true" if runtime.settings.api_key is not None else "false"
    return HTMLResponse(_page().replace(AUTH_PLACEHOLDER, auth), headers={
        "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})


def install(app: FastAPI) -> None:
    """The page route plus its static assets (JS, CSS, icon) under /viz/static."""
    app.include_router(router)
    app.mount(STATIC_PATH, StaticFiles(packages=[STATIC_PACKAGE]), name="viz-static")
