"""The production CPU path over HTTP: an artifact exported with --engine-graph.

`make run` and the CPU image export engine.onnx and engine_mixed.onnx (GroupQueryAttention,
KV cache updated in place; the second with mixed steps); the server must pick the mixed
one by default, say so in /info, and still give, for concurrent requests that join and
share decode steps, exactly the greedy tokens of the plain model.onnx reference loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
from service.contract.manifest import verify_manifest
from tests.service.helpers import ServerProcess, gated_serving, serving, wait_metric

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O", "KING HENRY:"]


@pytest.fixture(scope="module")
def engine_artifact(tiny_engine_artifact: Path) -> Path:
    """The tiny model with engine.onnx and engine_mixed.onnx (the session's export)."""
    return tiny_engine_artifact


@pytest.fixture(scope="module")
def server(engine_artifact: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """Runs freely behind a step gate, so a test can hold the engine while requests queue."""
    yield from gated_serving(engine_artifact, tmp_path_factory.mktemp("log") / "server.log")


def test_manifest_lists_the_engine_graphs(engine_artifact: Path) -> None:
    files = verify_manifest(engine_artifact).files
    assert ENGINE_FILE in files and ENGINE_MIXED_FILE in files


def test_server_decodes_with_the_engine_graph(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/info", timeout=10).json()
    assert info["decode_graph"] == ENGINE_MIXED_FILE
    assert [(g["file"], g["runs"], g["row_groups"]) for g in info["graphs"]] == [
        (ENGINE_MIXED_FILE, "steps", 2)]


def test_concurrent_greedy_requests_equal_the_reference_loop(
        server: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    lengths = [20, 7, 33, 12, 26, 15]  # rows leave the batch at different steps

    def generate(i: int) -> list[int]:
        r = httpx.post(f"{server.url}/generate", timeout=60, json={
            "inputs": PROMPTS[i], "parameters": {"max_new_tokens": lengths[i], "details": True}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    # Requests sent at once may still reach the engine one after another on a busy
    # machine. So the first one is held mid-decode while the others queue behind it: all
    # of them join its batch, whatever the machine's speed.
    gate = server.gate
    assert gate is not None
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        gate.send("-")
        try:
            first = pool.submit(generate, 0)
            gate.send(".")  # its prefill; its first decode step waits at the gate
            wait_metric(server, "attnserve_num_requests_running", 1)
            rest = [pool.submit(generate, i) for i in range(1, len(PROMPTS))]
            # the loop is held inside a step: nobody is admitted until the gate opens
            wait_metric(server, "attnserve_num_requests_waiting", len(rest))
        finally:
            gate.send("+")
        got = [first.result(), *(f.result() for f in rest)]
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == reference_greedy(encode(prompt), lengths[i]), prompt
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    batched = [line for line in metrics.splitlines()
               if line.startswith('attnserve_batch_size_bucket{le="1.0"}')]
    total = [line for line in metrics.splitlines()
             if line.startswith("attnserve_batch_size_count")]
    assert batched and total
    assert float(total[0].split()[-1]) > float(batched[0].split()[-1])  # steps with >1 row


SYSTEM = ("You are a careful assistant. Answer briefly, in plain words, and cite the "
          "standard library where you can.\n")


@pytest.fixture(scope="module")
def poison(encode: Callable[[str], list[int]]) -> int:
    token = encode("Z")[0]
    assert all(token not in encode(p) for p in [*PROMPTS, SYSTEM])
    return token


@pytest.fixture(scope="module")
def tuned(engine_artifact: Path, poison: int, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ServerProcess]:
    """Prefix caching in blocks of 4, fixed prefill chunks of 16, a step gate and a poison
    token."""
    yield from gated_serving(engine_artifact, tmp_path_factory.mktemp("log") / "server.log",
                             ("--prefix-block-size", "4", "--prefill-chunk-tokens", "16",
                              "--no-adaptive-prefill-chunks"),
                             env={"ATTNSERVE_TEST_POISON": str(poison)})


@pytest.fixture(scope="module")
def uncached(engine_artifact: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[ServerProcess]:
    yield from serving(engine_artifact, tmp_path_factory.mktemp("log") / "server.log",
                       ("--no-prefix-caching", "--prefill-chunk-tokens", "0"))


def greedy_ids(url: str, prompt: str, n: int) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_prefix_caching_on_and_off_give_the_reference_tokens(
        tuned: ServerProcess, uncached: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    from tests.service.helpers import metric_value

    prompts = [SYSTEM + p for p in PROMPTS]
    lengths = [9, 14, 6, 11, 17, 8]
    expected = [reference_greedy(encode(p), n) for p, n in zip(prompts, lengths, strict=True)]
    for server in (tuned, uncached):
        assert greedy_ids(server.url, prompts[0], lengths[0]) == expected[0]  # warms the cache
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda i, s=server: greedy_ids(s.url, prompts[i], lengths[i]),
                                range(len(prompts))))
        assert got == expected
    on = httpx.get(f"{tuned.url}/metrics").text
    off = httpx.get(f"{uncached.url}/metrics").text
    shared = (len(encode(SYSTEM)) // 4) * 4
    assert metric_value(on, "attnserve_prefix_cache_hits_total") >= len(prompts) * shared
    assert 0 < metric_value(on, "attnserve_prefix_cache_hit_rate") < 1
    assert metric_value(on, "attnserve_prefix_cache_blocks") > 0
    assert metric_value(off, "attnserve_prefix_cache_hits_total") == 0
    assert metric_value(off, "attnserve_prefix_cache_capacity_blocks") == 0


def test_a_long_prompt_is_prefilled_in_chunks_with_the_reference_tokens(
        tuned: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    from tests.service.helpers import metric_value

    long = " ".join(PROMPTS) + " " + PROMPTS[1]
    ids = encode(long)
    assert len(ids) > 3 * 16
    before = metric_value(httpx.get(f"{tuned.url}/metrics").text,
                          "attnserve_prefill_duration_seconds_count")
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(greedy_ids, tuned.url, PROMPTS[0], 30)
        joined = pool.submit(greedy_ids, tuned.url, long, 12)
        assert joined.result() == reference_greedy(ids, 12)
        assert running.result() == reference_greedy(encode(PROMPTS[0]), 30)
    after = metric_value(httpx.get(f"{tuned.url}/metrics").text,
                         "attnserve_prefill_duration_seconds_count")
    # Whatever the prefix cache reused, the rest of the long prompt went in 16 at a time.
    assert after - before >= 1 + 2


@pytest.mark.step_failures
def test_a_poisoned_prefill_is_424_while_its_neighbours_succeed(
        tuned: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    from tests.service.helpers import metric_value

    bad = "Zounds! " + PROMPTS[0]
    failures = "attnserve_step_failures_total"
    before = metric_value(httpx.get(f"{tuned.url}/metrics").text, failures, {"kind": "failed"})

    def post(path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(f"{tuned.url}{path}", json=body, timeout=60)

    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(greedy_ids, tuned.url, PROMPTS[i], 10) for i in (1, 3)]
        tgi = pool.submit(post, "/generate", {"inputs": bad})
        model = httpx.get(f"{tuned.url}/v1/models").json()["data"][0]["id"]
        v1 = pool.submit(post, "/v1/completions", {"model": model, "prompt": bad})
        for i, future in zip((1, 3), good, strict=True):
            assert future.result() == reference_greedy(encode(PROMPTS[i]), 10)
        assert tgi.result().status_code == 424
        assert tgi.result().json()["error_type"] == "generation"
        assert "poison" in tgi.result().json()["error"]
        assert v1.result().status_code == 424
        assert "poison" in v1.result().json()["error"]["message"]
    # Each poisoned prompt failed alone once, whether it came in a wave (retried) or not.
    after = metric_value(httpx.get(f"{tuned.url}/metrics").text, failures, {"kind": "failed"})
    assert after - before == 2


@pytest.mark.step_failures
def test_a_failed_decode_step_is_424_and_the_next_request_succeeds(
        tuned: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    from tests.service.helpers import metric_value

    gate = tuned.gate
    assert gate is not None
    gate.send("-")  # the engine is idle: the next passes are the ones below
    try:
        gate.send(".!")  # the prefill runs, the first decode step raises
        failed = httpx.post(f"{tuned.url}/generate", timeout=60, json={
            "inputs": PROMPTS[2], "parameters": {"max_new_tokens": 20}})
    finally:
        gate.send("+")
    assert failed.status_code == 424, failed.text
    assert failed.json()["error_type"] == "generation"
    assert "injected fault" in failed.json()["error"]
    assert greedy_ids(tuned.url, PROMPTS[2], 20) == reference_greedy(encode(PROMPTS[2]), 20)
    metrics = httpx.get(f"{tuned.url}/metrics").text
    assert metric_value(metrics, "attnserve_kv_cache_slots_used") == 0
    assert metric_value(metrics, "attnserve_step_failures_total", {"kind": "failed"}) >= 1
    assert metric_value(metrics, "attnserve_step_failures_total", {"kind": "loop"}) == 0


def test_kv_metrics_report_what_the_pool_holds(
        tuned: ServerProcess, engine_artifact: Path, encode: Callable[[str], list[int]]) -> None:
    from service.contract import io_spec as io
    from tests.service.helpers import first_sse, metric_value

    config = io.ArtifactConfig.load(engine_artifact)
    token_bytes = 2 * config.n_layers * config.d_model * 4
    idle = httpx.get(f"{tuned.url}/metrics").text
    assert metric_value(idle, "attnserve_kv_cache_slots") == 32  # default max_batch_size
    assert metric_value(idle, "attnserve_kv_cache_bytes") == 32 * config.max_seq_len * token_bytes
    assert metric_value(idle, "attnserve_kv_cache_capacity_tokens") == 32 * config.max_seq_len
    assert metric_value(idle, "attnserve_kv_cache_slots_used") == 0
    assert metric_value(idle, "attnserve_kv_cache_tokens") == 0
    gate = tuned.gate
    assert gate is not None
    prompt = PROMPTS[0]
    assert len(encode(prompt)) < 16  # one prefill pass, no chunks
    gate.send("-")
    try:
        with httpx.stream("POST", f"{tuned.url}/generate_stream", timeout=60, json={
                "inputs": prompt, "parameters": {"max_new_tokens": 20}}) as r:
            lines = r.iter_lines()
            gate.send(".")
            first_sse(lines)  # prefilled; its first decode step waits at the gate
            deadline = time.monotonic() + 20  # the loop reports its load right after the join
            while metric_value(held := httpx.get(f"{tuned.url}/metrics").text,
                               "attnserve_kv_cache_slots_used") != 1:
                assert time.monotonic() < deadline, held
            gate.send("+")
            list(lines)
    finally:
        gate.send("+")
    assert metric_value(held, "attnserve_kv_cache_slots_used") == 1
    assert metric_value(held, "attnserve_kv_cache_tokens") == len(encode(prompt))
    assert metric_value(held, "attnserve_kv_cache_usage_perc") == pytest.approx(
        len(encode(prompt)) / (32 * config.max_seq_len))
    # Resident pool memory follows the tokens held: each (layer, K or V, head) stretch of the
    # row's slot has the pages its cached tokens touched, and nothing else is in RAM.
    stretch = config.max_seq_len * config.head_dim * 4  # bytes of one head's slot stretch
    assert stretch % 4096 == 0
    pages = math.ceil(len(encode(prompt)) * config.head_dim * 4 / 4096)
    assert metric_value(held, "attnserve_kv_cache_resident_bytes") == \
        2 * config.n_layers * config.kv_heads * pages * 4096
    deadline = time.monotonic() + 20
    while metric_value(idle := httpx.get(f"{tuned.url}/metrics").text,
                       "attnserve_kv_cache_slots_used") != 0:
        assert time.monotonic() < deadline, idle
    assert metric_value(idle, "attnserve_kv_cache_resident_bytes") == 0  # given back on leave
