"""/viz in a real browser, and /attention's format=bertviz fed to the real bertviz package.

Headless Chromium from Debian's `chromium` package (deploy/install-system-deps.sh installs
it) is driven by Playwright's Python package through `executable_path`; Playwright's own
browser download is never used. Every page load intercepts all requests: one to any other
origin is aborted and fails the test, as does any console error or uncaught exception.

The step-by-step view's numbers (full precision in data attributes) are compared with
/attention JSON fetched by the test itself, and with numpy's softmax(q·kᵀ/√d_k + mask)
and Σ αⱼvⱼ recomputed from that JSON's q, k and v. One server (API key set) serves the
tiny artifact; a second serves a random-weight model with 12 heads and a 320-token context
for the 300-token check. Screenshots go to $ATTNSERVE_VIZ_SCREENSHOTS when set (the README
images come from there), else to a temporary directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from PIL import Image

from service.contract import io_spec as io
from service.contract.control_vector import ControlVector, write_control_vector
from tests.conftest import tiny_corpus, torch_threads
from tests.service.helpers import ServerProcess, serving

KEY = "viz-test-key"
PROMPT = "Return the number of items in the container."
MAX_NEW = 8
CHROMIUM = "/usr/bin/chromium"
ALL_KINDS = ["q", "k", "v", "scores", "scaled_scores", "weights"]
LONG_TOKENS = 300
LONG_CONTEXT = 320
# Functions, not expression strings: Playwright evals a string in the page, which the
# page's Content-Security-Policy (no 'unsafe-eval') rightly refuses.
RUN_ENABLED = "() => !document.getElementById('run').disabled"


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any]) -> Any:
    return start_server(env={"ATTNSERVE_API_KEY": KEY})


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (dev extra)")
    path = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if path is None:
        pytest.skip("Debian's chromium is not installed (deploy/install-system-deps.sh "
                    "installs it when run as root)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("ATTNSERVE_VIZ_SCREENSHOTS")
    out = Path(configured) if configured else tmp_path_factory.mktemp("viz-shots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass
class Watch:
    """Everything a page did: requests, console errors, page errors, foreign requests."""

    origin: str
    requests: list[Any] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def route(self, route: Any) -> None:
        url = route.request.url
        if _origin(url) == self.origin:
            route.continue_()
        else:
            self.foreign.append(url)
            route.abort()

    def paths(self) -> list[str]:
        return [urlsplit(r.url).path for r in self.requests]

    def assert_clean(self, allowed_console: tuple[str, ...] = ()) -> None:
        assert self.foreign == [], f"requests to other hosts: {self.foreign}"
        assert all(_origin(r.url) == self.origin for r in self.requests)
        assert self.page_errors == []
        unexpected = [m for m in self.console_errors if not any(a in m for a in allowed_console)]
        assert unexpected == [], unexpected


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def open_page(browser: Any, url: str, key: str | None = KEY) -> tuple[Any, Watch]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    if key is not None:  # as if typed earlier in this tab
        context.add_init_script(f"sessionStorage.setItem('attnserve.apiKey', {json.dumps(key)})")
    watch = Watch(_origin(url))
    context.route("**/*", watch.route)
    page = context.new_page()
    page.on("request", lambda r: watch.requests.append(r))
    page.on("console", lambda m: watch.console_errors.append(m.text) if m.type == "error"
            else None)
    page.on("pageerror", lambda e: watch.page_errors.append(str(e)))
    page.goto(f"{url}/viz")
    return page, watch


def save_shot(locator: Any, path: Path) -> None:
    """An element screenshot, reduced to a 256-colour PNG so the committed files stay small."""
    image = Image.open(BytesIO(locator.screenshot())).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def run_prompt(page: Any, prompt: str, continuation: bool, timeout: float = 60_000) -> None:
    page.wait_for_function(RUN_ENABLED)
    page.fill("#prompt", prompt)
    page.set_checked("#continue", continuation)
    page.fill("#max-new", str(MAX_NEW))
    page.click("#run")
    page.wait_for_selector("#status[data-state=ready]", timeout=timeout)


def step_numbers(page: Any, layer: int, head: int, query: int) -> dict[str, Any]:
    """Open the step view at (layer, head, query) with the toolbar; read its numbers."""
    page.click("[data-view=step]")
    page.select_option("#layer", str(layer))
    page.select_option("#head", str(head))
    page.select_option("#query", str(query))
    page.wait_for_selector(f"#step[data-layer='{layer}'][data-head='{head}']"
                           f"[data-query='{query}'] #step-table", timeout=60_000)
    return dict(page.evaluate("""() => ({
        dk: Number(document.getElementById('step-dk').dataset.value),
        q: JSON.parse(document.getElementById('step-q').dataset.values),
        out: JSON.parse(document.getElementById('step-out').dataset.values),
        rows: [...document.querySelectorAll('#step-table tr.key')].map((tr) => ({
            j: Number(tr.dataset.j), score: tr.dataset.score, scaled: tr.dataset.scaled,
            alpha: tr.dataset.alpha, masked: tr.dataset.masked === 'true'})),
        summary: [...document.querySelectorAll('#step-table tr.summary')].map((tr) => ({
            from: Number(tr.dataset.maskedFrom), count: Number(tr.dataset.maskedCount)})),
        checks: {...document.getElementById('step-checks').dataset},
    })"""))


def reference(client: httpx.Client, text: str, layer: int, head: int) -> dict[str, np.ndarray]:
    """/attention JSON for one (layer, head): q, k, v (T, d), matrices (T, T); null → -inf."""
    r = client.post("/attention", json={"inputs": text, "include": ALL_KINDS,
                                        "layers": [layer], "heads": [head]})
    assert r.status_code == 200, r.text
    body = r.json()
    out = {kind: np.array([[-math.inf if x is None else x for x in row]
                           for row in body["attention"][kind][0][0]], dtype=np.float64)
           for kind in ALL_KINDS}
    out["tokens"] = np.array([t["text"] for t in body["tokens"]], dtype=object)
    return out


def check_step(shown: dict[str, Any], ref: dict[str, np.ndarray], query: int) -> None:
    """The step view shows the server's numbers exactly, and numpy's recomputation agrees."""
    t, d = ref["q"].shape
    i = query
    assert shown["dk"] == d
    assert shown["q"] == ref["q"][i].tolist()  # same float32 values, same shortest repr
    rows = {r["j"]: r for r in shown["rows"]}
    masked_after = t - i - 1
    if shown["summary"]:
        assert shown["summary"] == [{"from": i + 1, "count": masked_after}]
        assert sorted(rows) == list(range(i + 1))
    else:
        assert sorted(rows) == list(range(t))
    js = np.array(sorted(rows))
    score = np.array([float(rows[j]["score"]) for j in js])
    scaled = np.array([float(rows[j]["scaled"]) for j in js])
    alpha = np.array([float(rows[j]["alpha"]) for j in js])
    np.testing.assert_array_equal(score, ref["scores"][i, js])
    np.testing.assert_array_equal(scaled, ref["scaled_scores"][i, js])
    np.testing.assert_array_equal(alpha, ref["weights"][i, js])
    assert [rows[j]["masked"] for j in js] == [j > i for j in js]

    # numpy from q, k, v alone: s = q·kⱼ, ŝ = s/√d_k + mask, α = softmax(ŝ), o = Σ αⱼvⱼ.
    s = ref["k"] @ ref["q"][i]  # (T,)
    s_hat = np.where(np.arange(t) <= i, s / math.sqrt(d), -np.inf)
    a = np.exp(s_hat - s_hat.max())
    a /= a.sum()
    np.testing.assert_allclose(score, s[js], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scaled, s_hat[js], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(alpha, a[js], atol=1e-6)
    assert np.all(alpha[js > i] == 0.0)
    np.testing.assert_allclose(np.array(shown["out"]), a @ ref["v"], atol=1e-5)
    assert float(shown["checks"]["sum"]) == pytest.approx(1.0, abs=1e-5)


def canvas_ink(page: Any, selector: str) -> int:
    """How many pixels of a canvas are painted (alpha > 0)."""
    return int(page.evaluate("""(sel) => {
        const c = document.querySelector(sel);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let p = 3; p < d.length; p += 4) if (d[p] > 0) n++;
        return n;
    }""", selector))


def head_row_center(page: Any, index: int, side: str) -> dict[str, float]:
    """Where token `index` sits on the head-view canvas (20 px rows under a 28 px title)."""
    box = page.locator("#head-canvas").bounding_box()
    x = 8.0 if side == "left" else box["width"] - 90.0
    return {"x": x, "y": 28 + index * 20 + 10}


# ---------------------------------------------------------------------------- server side


def test_page_and_assets_are_public_the_data_is_not(server: Any) -> None:
    page = httpx.get(f"{server.url}/viz")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert '<meta name="attnserve-auth-required" content="true">' in page.text
    scripts = re.findall(r'src="(viz/static/[^"]+)"', page.text)
    assert scripts == ["viz/static/main.js"]
    for asset, kind in (("main.js", "javascript"), ("stepview.js", "javascript"),
                        ("viz.css", "text/css"), ("icon.svg", "image/svg+xml")):
        r = httpx.get(f"{server.url}/viz/static/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"], asset
        body = r.text.replace("http://www.w3.org/2000/svg", "")  # a namespace, not a fetch
        assert "http://" not in body and "https://" not in body, f"{asset} names another host"
    assert httpx.get(f"{server.url}/viz/static/nothing.js").status_code == 404
    assert httpx.post(f"{server.url}/attention", json={"inputs": "a"}).status_code == 401


def test_bertviz_format_renders_in_bertviz(client: httpx.Client) -> None:
    bertviz = pytest.importorskip("bertviz", reason="bertviz (dev extra)")
    torch = pytest.importorskip("torch")
    text = "Return the number of items"
    data = client.post("/attention", json={"inputs": text, "format": "bertviz"}).json()
    full = client.post("/attention", json={"inputs": text}).json()
    tokens = [t["text"] for t in full["tokens"]]
    weights = np.asarray(full["attention"]["weights"])  # (L, H, T, T)
    assert data["tokens"] == tokens and data["token_ids"] == [t["id"] for t in full["tokens"]]
    assert data["layers"] == full["layers"] and data["heads"] == full["heads"]
    assert len(data["attention"]) == weights.shape[0]
    for layer, matrix in enumerate(data["attention"]):
        assert np.asarray(matrix).shape == (1, *weights.shape[1:])
        np.testing.assert_array_equal(np.asarray(matrix)[0], weights[layer])

    attention = [torch.tensor(a) for a in data["attention"]]  # what a notebook does
    for view in (bertviz.head_view, bertviz.model_view):
        html = view(attention, data["tokens"], html_action="return").data
        params = json.loads(re.search(r"const params = (\{.*?\}); // HACK", html, re.S)[1])
        shown = params["attention"][0]
        assert shown["left_text"] == tokens and shown["right_text"] == tokens
        np.testing.assert_allclose(np.asarray(shown["attn"]), weights, atol=1e-7)

    some = client.post("/attention", json={"inputs": text, "format": "bertviz",
                                           "layers": [1], "heads": [3, 0]}).json()
    np.testing.assert_array_equal(np.asarray(some["attention"]), weights[[1]][:, [3, 0]][:, None])
    bad = client.post("/attention", json={"inputs": text, "format": "bertviz",
                                          "include": ["q"]})
    assert bad.status_code == 422 and bad.json()["error"].startswith("include:"), bad.text


# ---------------------------------------------------------------------------- in the browser


def test_api_key_is_asked_for_kept_for_the_tab_and_sent(chromium: Any, server: Any) -> None:
    page, watch = open_page(chromium, server.url, key=None)
    page.wait_for_selector("#auth:not([hidden])")
    assert page.inner_text("#model-info") == "API key required"
    assert "/info" not in watch.paths()  # the page knew from the meta tag; no 401 needed
    assert page.is_disabled("#run")

    page.fill("#api-key", "wrong")
    page.click("#auth-form button")
    page.wait_for_function("() => document.getElementById('auth-message').textContent"
                           ".includes('refused')")
    assert page.is_disabled("#run")

    page.fill("#api-key", KEY)
    page.click("#auth-form button")
    page.wait_for_function(RUN_ENABLED)
    assert page.is_hidden("#auth")
    assert page.evaluate("() => sessionStorage.getItem('attnserve.apiKey')") == KEY
    sent = [r.headers.get("authorization") for r in watch.requests
            if urlsplit(r.url).path == "/info"]
    assert sent == ["Bearer wrong", f"Bearer {KEY}"]
    assert all("authorization" not in r.headers for r in watch.requests
               if urlsplit(r.url).path.startswith("/viz"))

    page.reload()  # same tab: the key is kept, nothing is asked
    page.wait_for_function(RUN_ENABLED)
    assert page.is_hidden("#auth")
    run_prompt(page, "Return the", continuation=False)
    attention = [r for r in watch.requests if urlsplit(r.url).path == "/attention"]
    assert attention and attention[-1].headers["authorization"] == f"Bearer {KEY}"
    # The refused key's 401 is the one console error the browser itself logs.
    watch.assert_clean(allowed_console=("401",))
    page.context.close()


def test_three_views_over_prompt_and_continuation(chromium: Any, server: Any,
                                                  client: httpx.Client, artifact: Path,
                                                  shots: Path) -> None:
    config = io.ArtifactConfig.load(artifact)
    generated = client.post("/generate", json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW}}).json()["generated_text"]
    text = PROMPT + generated
    full = client.post("/attention", json={"inputs": text}).json()
    tokens = [t["text"] for t in full["tokens"]]
    t = len(tokens)

    page, watch = open_page(chromium, server.url)
    assert page.is_hidden("#adapter-pick")  # the server serves no adapter: no comparison
    run_prompt(page, PROMPT, continuation=True)
    state = page.evaluate("""() => { const s = window.attnviz.state;
        return {text: s.text, T: s.model.T, L: s.model.L, H: s.model.H,
                tokens: s.model.tokens.map((t) => t.text),
                generated: s.model.tokens.map((t) => t.generated)}; }""")
    assert state["text"] == text  # the continuation came from /generate, same engine
    assert page.inner_text("#continuation mark").replace("↵", "") == generated
    assert state["tokens"] == tokens and state["T"] == t
    assert (state["L"], state["H"]) == (config.n_layers, config.n_heads)
    assert state["generated"][0] is False and state["generated"][-1] is (generated != "")

    # Head view: lines drawn; hovering a query focuses it; clicking picks it as the query.
    assert canvas_ink(page, "#head-canvas") > 0
    page.select_option("#layer", "1")
    page.wait_for_selector("#head-canvas[data-layer='1']")  # layer 1 fetched and drawn
    page.click("#heads-none")
    assert page.evaluate("() => window.attnviz.state.heads.size") == 0
    for h in (0, 2):
        page.click(f"#heads .chip[data-head='{h}']")
    assert page.evaluate("() => [...window.attnviz.state.heads].sort()") == [0, 2]
    page.hover("#head-canvas", position=head_row_center(page, 6, "left"))
    save_shot(page.locator("#views"), shots / "head-view.png")
    page.click("#head-canvas", position=head_row_center(page, 4, "left"))
    assert page.input_value("#query") == "4"

    # Model view: every layer × head; α = 1 at (0, 0) and 0 above the diagonal, in viridis.
    page.click("[data-view=model]")
    thumbs = page.locator("canvas.thumb")
    assert thumbs.count() == config.n_layers * config.n_heads
    page.wait_for_selector("canvas.thumb[data-layer='1'][data-head='2'][data-ready]")
    page.click("canvas.thumb[data-layer='1'][data-head='2']")
    assert page.inner_text("#detail-title") == "layer 1 · head 2"
    assert (page.input_value("#layer"), page.input_value("#head")) == ("1", "2")
    corners = page.evaluate("""() => {
        const c = document.querySelector("canvas.thumb[data-layer='1'][data-head='2']");
        const g = c.getContext('2d');
        const at = (x) => [...g.getImageData(x, 0, 1, 1).data];
        return [at(0), at(c.width - 1)];
    }""")
    assert corners == [[253, 231, 37, 255], [68, 1, 84, 255]]
    page.select_option("#query", str(t - 3))
    save_shot(page.locator("#views"), shots / "model-view.png")

    # Step by step, reached from the opened map, then moved with the toolbar.
    page.click("#detail-step")
    shown = step_numbers(page, 1, 2, t - 3)
    check_step(shown, reference(client, text, 1, 2), t - 3)
    save_shot(page.locator("#views"), shots / "step-view.png")
    shown = step_numbers(page, 0, 3, 2)
    check_step(shown, reference(client, text, 0, 3), 2)
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#step[data-query='3'] #step-table")
    check_step(step_numbers(page, 0, 3, 3), reference(client, text, 0, 3), 3)
    assert "/generate" in watch.paths()
    watch.assert_clean()
    page.context.close()


def check_lens(page: Any, want: dict[str, Any], t: int, query: int) -> None:
    """The lens table and the attribution grid on ``page`` hold ``want``'s (/attention JSON
    with logit_lens and head_attribution at ``query``) values."""
    shown = page.evaluate("""() => ({
        lens: [...document.querySelectorAll('#lens-table td')].map((c) => [
            Number(c.dataset.layer), Number(c.dataset.pos), Number(c.dataset.token),
            Number(c.dataset.prob)]),
        attr: [...document.querySelectorAll('#attr-table td')].map((c) => [
            Number(c.dataset.layer), c.dataset.head, Number(c.dataset.value)]),
        target: Number(document.querySelector('#lens [data-target]').dataset.target)})""")
    lens = want["logit_lens"]
    assert len(shown["lens"]) == len(want["layers"]) * t
    for layer, pos, token, prob in shown["lens"]:
        row = want["layers"].index(layer)
        assert token == lens["top_ids"][row][pos][0]
        assert prob == pytest.approx(lens["top_probs"][row][pos][0], abs=1e-6)
    attr = want["head_attribution"]
    assert shown["target"] == attr["target"] and attr["position"] == query
    for layer, head, value in shown["attr"]:
        expected = attr["mlp"][layer] if head == "mlp" else attr["heads"][layer][int(head)]
        assert value == pytest.approx(expected, abs=1e-6)
    assert len(shown["attr"]) == len(attr["heads"]) * (len(attr["heads"][0]) + 1)


def test_logit_lens_and_head_attribution_views(chromium: Any, server: Any,
                                                client: httpx.Client, shots: Path) -> None:
    """The lens table shows /attention's logit_lens (top token and probability of every
    layer and position) and the attribution grid its head_attribution at the query; moving
    the query asks again. The reference is /attention JSON fetched by the test."""
    page, watch = open_page(chromium, server.url)
    run_prompt(page, PROMPT, continuation=False)
    t = page.evaluate("() => window.attnviz.state.model.T")
    page.click("[data-view=lens]")
    for query in (t - 1, 3):
        if query != t - 1:  # a lens cell picks its position as the query
            page.click(f"#lens-table td[data-layer='0'][data-pos='{query}']")
        page.wait_for_selector(f"#lens[data-query='{query}'] #attr-table")
        assert page.input_value("#query") == str(query)
        want = client.post("/attention", json={
            "inputs": PROMPT, "include": ["logit_lens", "head_attribution"], "top_k": 5,
            "position": query}).json()
        check_lens(page, want, t, query)
        assert "control vector" not in page.inner_text("#lens")
    save_shot(page.locator("#views"), shots / "lens-view.png")
    watch.assert_clean()
    page.context.close()


# ---------------------------------------------------------------------------- layer by layer


DEEP_LAYERS = 6


@pytest.fixture(scope="module")
def deep_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """Random weights, 6 layers x 4 heads: enough layers for the viewer to fetch in groups
    (numbers are checked against /attention, not PyTorch)."""
    import torch

    from export.to_onnx import export_artifact
    from model.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
    from model.config import GPTConfig
    from model.gpt import GPT

    tiny = load_checkpoint(tiny_checkpoint)
    config = GPTConfig(vocab_size=tiny.model.config.vocab_size, d_model=32, n_heads=4,
                       n_layers=DEEP_LAYERS, d_ff=64, max_seq_len=64)
    out = tmp_path_factory.mktemp("viz-deep")
    with torch_threads(1):
        torch.manual_seed(1)
        meta = CheckpointMeta(model=config, tokenizer=dict(tiny.meta.tokenizer))
        ckpt = save_checkpoint(out / "ckpt", GPT(config).eval(), meta,
                               (tiny_checkpoint / io.TOKENIZER_FILE).read_text("utf-8"))
        artifact = export_artifact(ckpt, out / "artifact", verify=False)
    proc = ServerProcess(artifact, out / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def thumbnails(page: Any) -> list[list[int]]:
    return list(page.evaluate("""() => [...document.querySelectorAll('canvas.thumb')].map(
        (c) => [...c.getContext('2d').getImageData(0, 0, c.width, c.height).data])"""))


def attention_bodies(watch: Watch) -> list[Any]:
    return [r.post_data_json for r in watch.requests if urlsplit(r.url).path == "/attention"]


def test_layers_are_fetched_on_demand_within_the_budget(chromium: Any,
                                                        deep_server: ServerProcess) -> None:
    server = deep_server

    def fetched(layer: int | None = None) -> np.ndarray:
        """/attention JSON weights, (L or 1, H, T, T), as the test asks for them."""
        body = {"inputs": PROMPT} if layer is None else {"inputs": PROMPT, "layers": [layer]}
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.post("/attention", json=body)
        return np.asarray(r.json()["attention"]["weights"], np.float32)

    # A graph cut down to some layers may fuse operations the whole graph cannot (a score
    # that is no longer an output): the same numbers to float32 rounding, not bit for bit.
    weights = fetched()  # (L, H, T, T)
    layers, heads, t = weights.shape[:3]
    assert layers == DEEP_LAYERS
    for layer in (0, 2):
        np.testing.assert_allclose(fetched(layer)[0], weights[layer], rtol=1e-5, atol=1e-7)

    # Reference: one page with the default budget (every missing layer in one request).
    page, watch = open_page(chromium, server.url, key=None)
    run_prompt(page, PROMPT, continuation=False)
    page.click("[data-view=model]")
    page.wait_for_selector(f"#model-grid[data-loaded='{layers}']")
    assert [b["layers"] for b in attention_bodies(watch)] == [[0], list(range(1, layers))]
    reference = thumbnails(page)
    page.context.close()

    # A budget of two layers' maps: requests of two layers at most, two layers kept.
    page, watch = open_page(chromium, server.url, key=None)
    page.wait_for_function(RUN_ENABLED)
    page.evaluate("(b) => { window.attnviz.state.budget = b; }", 2 * heads * t * t * 4)
    run_prompt(page, PROMPT, continuation=False)
    # The page opened on layer 0's weights alone, and shows the server's numbers.
    assert attention_bodies(watch) == [{"inputs": PROMPT, "include": ["weights"],
                                        "format": "npz", "layers": [0]}]
    held = page.evaluate("() => [...window.attnviz.state.model.store.maps.keys()]")
    assert held == [0]
    shown = page.evaluate("() => Array.from(window.attnviz.state.model.store.maps.get(0))")
    np.testing.assert_array_equal(np.asarray(shown, np.float32), fetched(0).ravel())
    assert canvas_ink(page, "#head-canvas") > 0

    page.click("[data-view=model]")
    page.wait_for_selector(f"#model-grid[data-loaded='{layers}']")
    asked = [b["layers"] for b in attention_bodies(watch)]
    assert asked == [[0], [1, 2], [3, 4], [5]]
    assert all(b["include"] == ["weights"] for b in attention_bodies(watch))
    assert page.evaluate("() => window.attnviz.state.model.store.maps.size") <= 2
    # The same pictures, painted layer by layer (a colour may round to the next entry).
    diff = np.abs(np.asarray(thumbnails(page), np.int64) - np.asarray(reference, np.int64))
    assert diff.max() <= 4, diff.max()

    # Opening an evicted layer fetches it again; its map and read-out use its numbers.
    page.click("canvas.thumb[data-layer='0'][data-head='3']")
    page.wait_for_selector("#detail-canvas[data-layer='0'][data-head='3'][data-ready]")
    assert [b["layers"] for b in attention_bodies(watch)][-1] == [0]
    page.click("[data-view=head]")
    page.select_option("#layer", "2")
    page.wait_for_selector("#head-canvas[data-layer='2']")
    shown = page.evaluate("() => Array.from(window.attnviz.state.model.store.maps.get(2))")
    np.testing.assert_array_equal(np.asarray(shown, np.float32), fetched(2).ravel())
    assert page.evaluate("() => window.attnviz.state.model.store.maps.size") <= 2
    watch.assert_clean()
    page.context.close()


# ---------------------------------------------------------------------------- full context


@pytest.fixture(scope="module")
def long_artifact(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, 2 layers × 12 heads (GPT-2's head count), a 320-token context; not
    verified against PyTorch (export tests do that), the numbers are checked against
    /attention and numpy here."""
    import torch

    from export.to_onnx import export_artifact
    from model.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
    from model.config import GPTConfig
    from model.gpt import GPT

    tiny = load_checkpoint(tiny_checkpoint)
    config = GPTConfig(vocab_size=tiny.model.config.vocab_size, d_model=48, n_heads=12,
                       n_layers=2, d_ff=96, max_seq_len=LONG_CONTEXT)
    out = tmp_path_factory.mktemp("viz-long")
    with torch_threads(1):
        torch.manual_seed(0)
        meta = CheckpointMeta(model=config, tokenizer=dict(tiny.meta.tokenizer))
        ckpt = save_checkpoint(out / "ckpt", GPT(config).eval(), meta,
                               (tiny_checkpoint / io.TOKENIZER_FILE).read_text("utf-8"))
        return export_artifact(ckpt, out / "artifact", verify=False)


@pytest.fixture(scope="module")
def long_server(long_artifact: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    proc = ServerProcess(long_artifact, tmp_path_factory.mktemp("log") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def long_text(encode: Callable[[str], list[int]]) -> str:
    """Stdlib-corpus prose of exactly LONG_TOKENS tokens or a little more (≤ context - 1)."""
    corpus = tiny_corpus()
    n = 400
    while len(encode(corpus[:n])) < LONG_TOKENS:
        n += 20
    return corpus[:n]


def test_full_context_input_stays_responsive(chromium: Any, long_server: ServerProcess,
                                             encode: Callable[[str], list[int]],
                                             shots: Path) -> None:
    server = long_server
    text = long_text(encode)
    t = len(encode(text))
    assert LONG_TOKENS <= t < LONG_CONTEXT
    page, watch = open_page(chromium, server.url, key=None)
    run_prompt(page, text, continuation=False, timeout=120_000)
    assert page.evaluate("() => window.attnviz.state.model.T") == t

    # Head view of 12 heads over 300 tokens: hovering several tokens answers each time.
    for i in (0, 150, t - 1):
        page.locator("#head-canvas").scroll_into_view_if_needed()
        page.hover("#head-canvas", position=head_row_center(page, i, "left"))
    assert canvas_ink(page, "#head-canvas") > 0
    page.click("[data-view=model]")
    assert page.locator("canvas.thumb").count() == 2 * 12
    page.select_option("#scale", "sqrt")  # random weights: near-uniform, faint α
    page.wait_for_selector("#model-grid[data-loaded='2']")
    page.click("canvas.thumb[data-layer='1'][data-head='11']")
    page.wait_for_selector("#detail-canvas[data-layer='1'][data-ready]")
    save_shot(page.locator("#views"), shots / "model-view-long.png")
    page.click("#detail-step")
    with httpx.Client(base_url=server.url, timeout=120) as client:
        check_step(step_numbers(page, 1, 11, 150), reference(client, text, 1, 11), 150)
    # The tab is not frozen: a frame is painted and a script answers after all of that.
    assert page.evaluate("() => new Promise((r) => requestAnimationFrame(() => r(true)))")
    watch.assert_clean()
    page.context.close()


# ---------------------------------------------------------------------------- adapter vs base


@pytest.fixture(scope="module")
def lora_server(lora_build: Any, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """The random-weight Llama (its artifact has the adapter graphs) serving one PEFT
    adapter, ``alpha`` (random A and B, rank 8 on all seven projections;
    tests/service/lora_build.py)."""
    adapter = lora_build.adapters["alpha"]
    root = tmp_path_factory.mktemp("viz-lora")
    proc = ServerProcess(lora_build.artifact, root / "server.log",
                         ("--device", "cpu", "--lora-modules", f"alpha={adapter}"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def head_weights(client: httpx.Client, text: str, layer: int, head: int,
                 adapter: str | None = None, vector: dict[str, Any] | None = None
                 ) -> np.ndarray:
    """/attention JSON weights of one (layer, head), (T, T), as float64 of the float32s."""
    body: dict[str, Any] = {"inputs": text, "layers": [layer], "heads": [head]}
    if adapter is not None:
        body["adapter_id"] = adapter
    if vector is not None:
        body["control_vector"] = vector
    r = client.post("/attention", json=body)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["attention"]["weights"][0][0], np.float64)


def compared_cell(page: Any) -> dict[str, float]:
    cell = page.evaluate("() => ({...document.getElementById('compare-cell').dataset})")
    return {k: float(v) for k, v in cell.items()}


def test_an_adapter_is_compared_with_the_base(chromium: Any, lora_server: ServerProcess,
                                              shots: Path) -> None:
    server = lora_server
    page, watch = open_page(chromium, server.url, key=None)
    page.wait_for_function(RUN_ENABLED)
    page.wait_for_selector("#adapter-pick:not([hidden])")
    assert page.eval_on_selector_all("#adapter option", "(os) => os.map((o) => o.value)") == [
        "", "alpha"]
    assert page.is_hidden(".tabs [data-view=compare]")
    page.select_option("#adapter", "alpha")
    run_prompt(page, PROMPT, continuation=False)
    page.wait_for_selector("#compare[data-ready][data-layer='0'][data-head='0']")
    assert page.get_attribute(".tabs [data-view=compare]", "aria-selected") == "true"
    for kind in ("base", "adapter", "diff"):
        assert canvas_ink(page, f"#compare canvas[data-kind='{kind}']") > 0, kind
    assert page.inner_text(".compare-title[data-kind='adapter']") == "adapter alpha"

    with httpx.Client(base_url=server.url, timeout=120) as client:
        def check(layer: int, head: int) -> None:
            base = head_weights(client, PROMPT, layer, head)
            tuned = head_weights(client, PROMPT, layer, head, "alpha")
            diff = tuned - base  # (T, T)
            # the read-out opens on the cell that changed most, with the server's numbers
            cell = compared_cell(page)
            i, j = int(cell["i"]), int(cell["j"])
            assert abs(diff[i, j]) == np.abs(diff).max() > 1e-4
            assert (cell["base"], cell["adapter"]) == (base[i, j], tuned[i, j])
            assert cell["diff"] == diff[i, j]
            shown = float(page.get_attribute("#compare-range", "data-range"))
            assert shown == np.abs(diff).max()
            # a cell clicked on the difference panel: (last query, first key)
            t = base.shape[0]
            size = {k: float(page.get_attribute("#compare", f"data-{k}"))
                    for k in ("cell", "margin")}
            page.click("#compare canvas[data-kind='diff']", position={
                "x": size["margin"] + 0.5 * size["cell"],
                "y": size["margin"] + (t - 0.5) * size["cell"]})
            cell = compared_cell(page)
            assert (cell["i"], cell["j"]) == (t - 1, 0)
            assert (cell["base"], cell["adapter"]) == (base[t - 1, 0], tuned[t - 1, 0])
            assert cell["diff"] == diff[t - 1, 0]

        check(0, 0)
        save_shot(page.locator("#views"), shots / "adapter-compare.png")
        page.select_option("#layer", "1")
        page.select_option("#head", "3")
        page.wait_for_selector("#compare[data-ready][data-layer='1'][data-head='3']")
        check(1, 3)

    bodies = attention_bodies(watch)
    assert {b.get("adapter_id") for b in bodies} == {None, "alpha"}
    assert [b["layers"] for b in bodies if b.get("adapter_id")] == [[0], [1]]
    # no adapter: the comparison closes, the page is the base's as before
    page.select_option("#adapter", "")
    assert page.is_hidden(".tabs [data-view=compare]") and page.is_hidden("#view-compare")
    assert page.get_attribute(".tabs [data-view=head]", "aria-selected") == "true"
    watch.assert_clean()
    page.context.close()


# ------------------------------------------------------------------ with vs without vector


@pytest.fixture(scope="module")
def steer_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A random-weight Llama of three layers (a vector added after block 1 reaches layer 2's
    attention), exported with its engine graphs, serving one control vector, ``v``: random
    directions for layers 1 and 2."""
    pytest.importorskip("transformers")
    from export.to_onnx import export_artifact
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    root = tmp_path_factory.mktemp("viz-steer")
    with torch_threads(1):
        build_hf_model(root / "hf", "llama", seed=1, num_hidden_layers=3)
        ckpt = import_hf_checkpoint(root / "hf", root / "ckpt")
        artifact = export_artifact(ckpt, root / "artifact", engine_graph=True, verify=False)
    d = io.ArtifactConfig.load(artifact).d_model
    rng = np.random.default_rng(2)
    vector = write_control_vector(ControlVector(
        {k: (rng.standard_normal(d) / np.sqrt(d)).astype(np.float32) for k in (1, 2)}),
        root / "v.gguf")
    yield from serving(artifact, root / "server.log",
                       ("--device", "cpu", "--control-vectors", f"v={vector}"))


def test_a_control_vector_is_compared_with_none(chromium: Any, steer_server: ServerProcess,
                                                shots: Path) -> None:
    server = steer_server
    page, watch = open_page(chromium, server.url, key=None)
    page.wait_for_function(RUN_ENABLED)
    page.wait_for_selector("#vector-pick:not([hidden])")
    assert page.is_hidden("#adapter-pick")  # no adapter served: only the vector is offered
    assert page.eval_on_selector_all("#vector option", "(os) => os.map((o) => o.value)") == [
        "", "v"]
    assert page.get_attribute("#vector-scale", "max") == "4"  # --max-control-scale's default
    page.fill("#vector-scale", "3")
    page.select_option("#vector", "v")
    run_prompt(page, PROMPT, continuation=False)
    page.wait_for_selector("#compare[data-ready][data-layer='0'][data-head='0']")
    tab = ".tabs [data-view=compare]"
    assert page.get_attribute(tab, "aria-selected") == "true"
    assert page.inner_text(tab) == "With vs without vector"
    assert page.inner_text(".compare-title[data-kind='base']") == "base, no vector"
    assert page.inner_text(".compare-title[data-kind='adapter']") == "base, vector v × 3"
    # layer 0 reads the embedding: no vector reaches it, the difference is nothing
    assert float(page.get_attribute("#compare-range", "data-range")) == 0.0
    control = {"name": "v", "scale": 3}
    page.select_option("#layer", "2")
    page.select_option("#head", "1")
    page.wait_for_selector("#compare[data-ready][data-layer='2'][data-head='1']")
    for kind in ("base", "adapter", "diff"):
        assert canvas_ink(page, f"#compare canvas[data-kind='{kind}']") > 0, kind
    with httpx.Client(base_url=server.url, timeout=120) as client:
        without = head_weights(client, PROMPT, 2, 1)
        steered = head_weights(client, PROMPT, 2, 1, vector=control)
    diff = steered - without  # (T, T)
    cell = compared_cell(page)
    i, j = int(cell["i"]), int(cell["j"])
    assert abs(diff[i, j]) == np.abs(diff).max() > 1e-4
    assert (cell["base"], cell["adapter"], cell["diff"]) == (without[i, j], steered[i, j],
                                                             diff[i, j])
    assert float(page.get_attribute("#compare-range", "data-range")) == np.abs(diff).max()
    save_shot(page.locator("#views"), shots / "vector-compare.png")
    bodies = attention_bodies(watch)
    assert {json.dumps(b.get("control_vector")) for b in bodies} == {
        "null", json.dumps(control)}
    assert [b["layers"] for b in bodies if b.get("control_vector")] == [[0], [2]]
    # no vector: the comparison closes, the page is the base's as before
    page.select_option("#vector", "")
    assert page.is_hidden(tab) and page.is_hidden("#view-compare")
    assert page.get_attribute(".tabs [data-view=head]", "aria-selected") == "true"
    watch.assert_clean()
    page.context.close()


def test_the_lens_and_attribution_are_computed_under_the_chosen_vector(
        chromium: Any, steer_server: ServerProcess, shots: Path) -> None:
    """With a vector and a scale picked, the lens and attribution views hold /attention's
    values under that vector (not the unsteered ones) and their captions name it; with
    none picked again they are the unsteered model's."""
    page, watch = open_page(chromium, steer_server.url, key=None)
    page.wait_for_function(RUN_ENABLED)
    page.wait_for_selector("#vector-pick:not([hidden])")
    page.fill("#vector-scale", "3")
    page.select_option("#vector", "v")
    run_prompt(page, PROMPT, continuation=False)
    t = page.evaluate("() => window.attnviz.state.model.T")
    page.click("[data-view=lens]")
    page.wait_for_selector(f"#lens[data-query='{t - 1}'][data-vector='v 3'] #attr-table")
    members = {"inputs": PROMPT, "include": ["logit_lens", "head_attribution"], "top_k": 5,
               "position": t - 1}
    control = {"name": "v", "scale": 3}
    with httpx.Client(base_url=steer_server.url, timeout=120) as client:
        steered = client.post("/attention", json=members | {"control_vector": control}).json()
        plain = client.post("/attention", json=members).json()
    # the vector changes what the lens and attribution show, so the check below can tell
    assert steered["head_attribution"]["heads"] != plain["head_attribution"]["heads"]
    check_lens(page, steered, t, t - 1)
    text = page.inner_text("#lens")
    assert "Logit lens: each layer's top next token, under control vector v × 3" in text
    assert text.count("under control vector v × 3") == 2  # the lens's and attribution's
    save_shot(page.locator("#views"), shots / "lens-vector.png")
    lens_bodies = [b for b in attention_bodies(watch) if "logit_lens" in b["include"]]
    assert [b.get("control_vector") for b in lens_bodies] == [control]
    # no vector: the lens is the unsteered model's again, its caption names none
    page.select_option("#vector", "")
    page.click("[data-view=lens]")
    page.wait_for_selector(f"#lens[data-query='{t - 1}'][data-vector=''] #attr-table")
    check_lens(page, plain, t, t - 1)
    assert "control vector" not in page.inner_text("#lens")
    watch.assert_clean()
    page.context.close()
