"""`docker-compose --profile scale up --scale attnserve=3`: HAProxy routes by prefix, and around.

Three replicas of the serving image behind the HAProxy image (both built from Debian
packages on the same base), Prometheus finding every replica by DNS. Requests through the
proxy with different prompts must reach every replica; requests sharing a prompt prefix
must land on one replica and hit its prefix cache there (its own /metrics); an adapter's
requests with one prompt land together whether they come as OpenAI's `model` or TGI's
`adapter_id`; three real PEFT adapters, served by every replica from a read-only mount
(`ATTNSERVE_ADAPTERS_DIR`, `ATTNSERVE_LORA_MODULES`), answer as PEFT over transformers does,
each on one replica (the header and the replicas' adapter counters agree); with one replica
killed (SIGKILL, nothing drained) under
load, every client still gets an answer, 200 or 503 with Retry-After, and none waits beyond
its timeout; with every replica stopped the proxy answers 503 itself; `docker-compose stop`
lets a stream through the proxy finish. The tests pass in any order: each brings the stack
back to the state it starts from. Load stays on
loopback and is bounded: 3 clients, 4 tokens a request, 20 s.
Same daemon and skip conditions as test_compose_e2e.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.docker_harness import (
    Compose,
    Stream,
    chat_body,
    free_port_range,
    post_json,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
REPLICAS = 3
START_S = 240.0  # three replicas load at once on a small machine
CLIENT_TIMEOUT_S = 60.0  # a hang would show up as this
# The adapters every replica serves: name -> the seed of PEFT's random A and B.
ADAPTER_SEEDS = {"lora-alpha": 1, "lora-beta": 2, "lora-gamma": 3}
ADAPTER_PROMPT = "The three primary colors are"
ADAPTER_TOKENS = 8
NEAR_TIE = 0.01  # a reference top-2 logit margin below this would not decide the token


@dataclass
class Scaled:
    compose: Compose

    @property
    def proxy(self) -> str:  # the host ports may change (Compose.up): read them each time
        return f"http://127.0.0.1:{self.compose.settings['PROXY_HOST_PORT']}"

    @property
    def proxy_stats(self) -> str:
        return f"http://127.0.0.1:{self.compose.settings['PROXY_STATS_HOST_PORT']}/stats;csv"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.compose.settings['PROMETHEUS_HOST_PORT']}"


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return response.read().decode()


def route_count(url: str, route: str = "/v1/chat/completions") -> float:
    """attnserve_requests_total for `route` answered 200, from one replica's /metrics."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text(url).splitlines()
               if line.startswith("attnserve_requests_total{")
               and f'route="{route}"' in line and 'status="200"' in line)


def prefix_cache(url: str) -> tuple[float, float]:
    """(hits, queries) of one replica's prefix cache, in prompt tokens."""
    values = dict(line.split(" ", 1) for line in metrics_text(url).splitlines()
                  if line.startswith(("attnserve_prefix_cache_hits_total ",
                                      "attnserve_prefix_cache_queries_total ")))
    return (float(values["attnserve_prefix_cache_hits_total"]),
            float(values["attnserve_prefix_cache_queries_total"]))


def lora_requests(url: str) -> dict[str, float]:
    """attnserve_lora_requests_total by adapter, from one replica's /metrics."""
    found = (re.match(r'attnserve_lora_requests_total\{adapter="([^"]+)"\} (\S+)$', line)
             for line in metrics_text(url).splitlines())
    return {m.group(1): float(m.group(2)) for m in found if m}


def wait_proxy_idle(scaled: Scaled) -> None:
    """Until HAProxy routes to every replica and has no request in flight (its stats): a
    replica still coming up would move keys on the hash ring, and a request still counted
    after its answer reached the client could make the next one spill over (the hash's
    load bound counts requests in flight)."""

    def idle() -> bool | None:
        with urllib.request.urlopen(scaled.proxy_stats, timeout=10) as response:
            rows = response.read().decode().splitlines()
        columns = rows[0].lstrip("# ").split(",")
        cells = [dict(zip(columns, row.split(","), strict=False)) for row in rows[1:]]
        ours = [c for c in cells if c["pxname"] == "attnserve"]
        up = [c for c in ours if c["svname"] not in ("BACKEND", "FRONTEND")
              and c["status"] == "UP"]
        busy = [c for c in ours if c["scur"] != "0"]
        return True if len(up) == REPLICAS and not busy else None

    wait_for(idle, 60, f"HAProxy to route to {REPLICAS} replicas with no request in flight")


def replicas_by_url(scaled: Scaled) -> dict[str, str]:
    """Each replica's container id -> its own published URL."""
    replicas = scaled.compose.containers("attnserve")
    assert len(replicas) == REPLICAS
    return {c: f"http://127.0.0.1:{scaled.compose.host_port(c)}" for c in replicas}


@dataclass
class Adapters:
    """PEFT adapters over the deploy model and what PEFT answers with each."""

    directory: Path  # ATTNSERVE_ADAPTERS_DIR: one PEFT adapter directory per name
    prompt_ids: list[int]  # ADAPTER_PROMPT by transformers' tokenizer of the GGUF file
    greedy: dict[str, list[int]]  # "" (the base) and each name -> greedy tokens
    text: dict[str, str]  # the same, decoded as an OpenAI completion's text

    @property
    def lora_modules(self) -> str:
        """ATTNSERVE_LORA_MODULES: each adapter where the replicas mount it."""
        return " ".join(f"{name}=/adapters/{name}" for name in ADAPTER_SEEDS)


def peft_greedy(model: Any, ids: list[int], eos: int) -> list[int]:
    """ADAPTER_TOKENS greedy tokens (the stop token kept, as the server keeps it) by a
    plain loop over the whole sequence, each one decided by a clear top-2 margin."""
    import torch

    seq: list[int] = list(ids)
    with torch.no_grad():
        for _ in range(ADAPTER_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1]  # (V,)
            top = torch.topk(logits, 2).values
            assert top[0] - top[1] >= NEAR_TIE, f"a near tie after {seq[len(ids):]}"
            seq.append(int(logits.argmax()))
            if seq[-1] == eos:
                break
    return seq[len(ids):]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory,
             smollm2_transformers: tuple[Any, Any]) -> Adapters:
    """Three LoRA adapters written by PEFT over transformers' model of the SmolLM2 GGUF file
    that the deploy model is exported from (PEFT's own random A and B,
    ``init_lora_weights=False``: B is not zero, so each changes the answer), and their greedy
    answers from that PEFT model: a reference that shares neither attnserve's adapter code
    nor its export, and knows nothing of the router."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from tests.conftest import torch_threads

    model, tok = smollm2_transformers
    directory = tmp_path_factory.mktemp("adapters")
    ids = tok(ADAPTER_PROMPT, add_special_tokens=False)["input_ids"]
    eos = int(model.generation_config.eos_token_id)
    with torch_threads(1):  # a shared machine: one thread is enough for 8 tokens
        greedy = {"": peft_greedy(model, ids, eos)}
        for name, seed in ADAPTER_SEEDS.items():
            torch.manual_seed(seed)
            config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
            # a copy: PEFT wraps the model it is given, and the session's is shared
            peft_model = get_peft_model(copy.deepcopy(model), config).eval()
            peft_model.save_pretrained(str(directory / name))
            greedy[name] = peft_greedy(peft_model, ids, eos)
            del peft_model
    for path in (directory, *directory.rglob("*")):  # the replicas run as uid 10001
        path.chmod(0o755 if path.is_dir() else 0o644)
    text = {k: tok.decode(v, skip_special_tokens=True) for k, v in greedy.items()}
    return Adapters(directory, ids, greedy, text)


@pytest.fixture(scope="module")
def scaled_stack(docker_daemon, deploy_images, deploy_model, adapters) -> Iterator[Scaled]:
    """The scaled compose project, made once per module (and storage driver), every replica
    serving the adapters."""

    def ports() -> dict[str, str]:
        first = free_port_range(REPLICAS + 1)
        return {"ATTNSERVE_HOST_PORTS": f"{first}-{first + REPLICAS}",
                "PROXY_HOST_PORT": str(free_port_range(1)),
                "PROXY_STATS_HOST_PORT": str(free_port_range(1)),
                "PROMETHEUS_HOST_PORT": str(free_port_range(1))}

    compose = Compose(docker_daemon, "attnserve-scale", {
        "ATTNSERVE_MODEL_DIR": str(deploy_model),
        # three replicas share the machine's cores: one ONNX Runtime thread each
        "ATTNSERVE_INTRA_OP_THREADS": "1",
        "ATTNSERVE_ADAPTERS_DIR": str(adapters.directory),
        "ATTNSERVE_LORA_MODULES": adapters.lora_modules,
    }, profiles=("scale",), ports=ports)
    compose.down()
    try:
        yield Scaled(compose)
    finally:
        print("\n".join(compose.transcript))
        print(compose.logs(tail=30))
        compose.down()


@pytest.fixture
def scaled(scaled_stack: Scaled) -> Scaled:
    """Every replica up, healthy and routed to before each test, whatever the tests before
    it did (one kills a replica, two stop the stack), so the tests pass in any order.
    `up -d` changes nothing on a stack that is already up: it starts what is not."""
    compose = scaled_stack.compose
    compose.up("-d", "--no-build", "--scale", f"attnserve={REPLICAS}", timeout=420)
    compose.wait_healthy("attnserve", REPLICAS, START_S)

    def routed() -> bool | None:
        status, _, _ = post_json(f"{scaled_stack.proxy}/v1/chat/completions",
                                 chat_body("Hi", 1), 30)
        return True if status == 200 else None

    wait_for(routed, 60, "the proxy to route a request")
    return scaled_stack


def test_requests_spread_over_every_replica(scaled) -> None:
    direct = replicas_by_url(scaled)
    before = {c: route_count(url) for c, url in direct.items()}
    results: list[int] = []

    def client(i: int) -> None:
        # 24 different prompts, so 24 routing keys: each replica's share of the hash ring
        # (a third) gets some (a replica missing all 24 has odds of 3 x (2/3)^24 = 2e-4).
        for j in range(8):
            status, _, _ = post_json(f"{scaled.proxy}/v1/chat/completions",
                                     chat_body(f"Count to {8 * i + j}.", 4), CLIENT_TIMEOUT_S)
            results.append(status)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_S * 4)
    assert results == [200] * 24
    served = {c: route_count(url) - before[c] for c, url in direct.items()}
    assert all(n >= 1 for n in served.values()), served
    assert sum(served.values()) == 24


def test_a_shared_prefix_lands_on_one_replica_and_hits_its_cache(scaled) -> None:
    direct = replicas_by_url(scaled)
    # A prefix of this run's own (no replica has it cached): ~100 tokens, six prefix blocks.
    prefix = f"Notes {uuid.uuid4().hex}: " + " ".join(f"river stone {i}" for i in range(30))
    before = {c: (route_count(url, "/v1/completions"), prefix_cache(url))
              for c, url in direct.items()}
    answered_by = []
    for i in range(6):  # one at a time: the replica's load never makes the hash spill over
        wait_proxy_idle(scaled)
        status, headers, raw = post_json(
            f"{scaled.proxy}/v1/completions",
            {"model": served_model(scaled), "prompt": f"{prefix}\nQuestion {i}: why?",
             "max_tokens": 2}, CLIENT_TIMEOUT_S)
        assert status == 200, raw[:300]
        assert json.loads(raw)["choices"][0]["text"] is not None
        answered_by.append(headers["x-attnserve-replica"])
    assert len(set(answered_by)) == 1, answered_by  # the proxy names one replica
    served = {c: route_count(url, "/v1/completions") - before[c][0]
              for c, url in direct.items()}
    (home,) = [c for c, n in served.items() if n]  # and the replicas' counters agree
    assert served[home] == 6, served
    hits, queries = (now - then for now, then in zip(prefix_cache(direct[home]),
                                                     before[home][1], strict=True))
    # The first request filled the cache with the prefix; the five after it hit it.
    assert hits >= 5 * 64, (hits, queries)
    for c, url in direct.items():
        if c != home:
            assert prefix_cache(url)[1] == before[c][1][1], c  # no prompt reached it


def test_an_adapters_requests_land_together_over_both_apis(scaled) -> None:
    # No replica serves these adapters, so each request is answered 404 by the replica the
    # proxy chose (the routing key does not depend on the adapter being there): the
    # OpenAI `model` and TGI's `parameters.adapter_id` name the same adapter, so one
    # adapter and prompt go to one replica whichever API asks.
    prompt = f"Adapter check {uuid.uuid4().hex}: what is the capital of France?"
    for adapter in ("tenant-a", "tenant-b", "tenant-c"):
        replicas = set()
        for _ in range(2):
            for path, body, marker in (
                    ("/v1/completions", {"model": adapter, "prompt": prompt, "max_tokens": 1},
                     "does not exist"),
                    ("/generate", {"inputs": prompt, "parameters": {
                        "max_new_tokens": 1, "adapter_id": adapter}}, "is not served")):
                wait_proxy_idle(scaled)
                status, headers, raw = post_json(f"{scaled.proxy}{path}", body,
                                                 CLIENT_TIMEOUT_S)
                assert status == 404 and marker in raw.decode(), (path, status, raw[:300])
                replicas.add(headers["x-attnserve-replica"])
        assert len(replicas) == 1, (adapter, replicas)


def test_served_adapters_answer_as_peft_each_on_one_replica(scaled, adapters) -> None:
    # Every replica serves the three adapters (ATTNSERVE_LORA_MODULES over the read-only
    # /adapters mount); the proxy sends each adapter's requests, as OpenAI's `model` and as
    # TGI's `adapter_id`, to one replica, whose answers are PEFT's greedy tokens.
    direct = replicas_by_url(scaled)
    before = {c: lora_requests(url) for c, url in direct.items()}
    base = {"prompt": ADAPTER_PROMPT, "max_tokens": ADAPTER_TOKENS, "temperature": 0}
    status, _, raw = post_json(f"{scaled.proxy}/v1/completions",
                               {**base, "model": served_model(scaled)}, CLIENT_TIMEOUT_S)
    assert status == 200, raw[:300]
    assert json.loads(raw)["choices"][0]["text"] == adapters.text[""]
    answered_by: dict[str, set[str]] = {}
    for name in ADAPTER_SEEDS:
        assert adapters.greedy[name] != adapters.greedy[""], name  # the adapter matters
        for _ in range(2):
            wait_proxy_idle(scaled)
            status, headers, raw = post_json(f"{scaled.proxy}/v1/completions",
                                             {**base, "model": name}, CLIENT_TIMEOUT_S)
            assert status == 200, (name, raw[:300])
            assert json.loads(raw)["choices"][0]["text"] == adapters.text[name], name
            answered_by.setdefault(name, set()).add(headers["x-attnserve-replica"])
            wait_proxy_idle(scaled)
            status, headers, raw = post_json(f"{scaled.proxy}/generate", {
                "inputs": ADAPTER_PROMPT, "parameters": {
                    "max_new_tokens": ADAPTER_TOKENS, "adapter_id": name, "details": True,
                    "decoder_input_details": True}}, CLIENT_TIMEOUT_S)
            assert status == 200, (name, raw[:300])
            details = json.loads(raw)["details"]
            assert [t["id"] for t in details["prefill"]] == adapters.prompt_ids
            assert [t["id"] for t in details["tokens"]] == adapters.greedy[name], name
            answered_by[name].add(headers["x-attnserve-replica"])
    assert all(len(slots) == 1 for slots in answered_by.values()), answered_by

    def grown() -> dict[str, dict[str, float]] | None:
        """adapter -> replica -> its requests since `before`, once all 12 are counted (a
        replica counts a request when its engine reports it, not before the answer)."""
        now = {c: lora_requests(url) for c, url in direct.items()}
        counted = {name: {c: now[c].get(name, 0.0) - before[c].get(name, 0.0)
                          for c in direct} for name in ADAPTER_SEEDS}
        return counted if sum(sum(n.values()) for n in counted.values()) >= 12 else None

    counted = wait_for(grown, 30, "the replicas to count the 12 adapter requests")
    homes: dict[str, str] = {}  # the proxy's slot name -> the container that counted
    for name, per_replica in counted.items():
        (home,) = [c for c, n in per_replica.items() if n]  # one replica ran them all
        assert per_replica[home] == 4, (name, per_replica)
        (slot,) = answered_by[name]
        assert homes.setdefault(slot, home) == home, (slot, homes, home)  # header agrees
    assert len(set(homes.values())) == len(homes), homes
    print("adapters by replica:", {name: slots.pop() for name, slots in answered_by.items()})


def served_model(scaled: Scaled) -> str:
    with urllib.request.urlopen(f"{scaled.proxy}/v1/models", timeout=10) as response:
        return str(json.load(response)["data"][0]["id"])


def test_prometheus_scrapes_every_replica(scaled, smoke) -> None:
    replicas = scaled.compose.containers("attnserve")
    addresses = {
        next(iter(scaled.compose.inspect(c)["NetworkSettings"]["Networks"].values()))
        ["IPAddress"] + ":8000" for c in replicas}

    def all_up() -> set[str] | None:
        targets = smoke.prometheus_api(scaled.prometheus, "targets",
                                       state="active")["activeTargets"]
        up = {t["labels"]["instance"] for t in targets
              if t["labels"]["job"] == "attnserve" and t["health"] == "up"}
        return up if up == addresses else None

    wait_for(all_up, 60, f"Prometheus to scrape {sorted(addresses)}", interval=1.0)


# HAProxy saw a replica go (health check failed: "is DOWN"; or DNS dropped it first: "is
# going DOWN for maintenance").
REPLICA_DOWN = re.compile(r"Server attnserve/attnserve\d+ is (going )?DOWN")
KILL_WAIT_S = 180.0  # load before the kill, then 10 answers and the DOWN line after it


def test_a_replica_killed_under_load_is_routed_around(scaled) -> None:
    victim = scaled.compose.containers("attnserve")[0]
    (proxy,) = scaled.compose.containers("proxy")
    outcomes: list[tuple[float, str]] = []  # (time, "200" | "503+retry-after" | failure)
    answered = [0, 0, 0]  # responses per client
    stop = threading.Event()
    started = time.monotonic()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                status, headers, raw = post_json(
                    f"{scaled.proxy}/v1/chat/completions",
                    chat_body(f"Say something about the number {i * 100 + n}.", 4),
                    CLIENT_TIMEOUT_S)
            except (OSError, urllib.error.URLError) as exc:  # reset, refused, or timed out
                outcomes.append((time.monotonic() - started, f"failed: {exc!r}"))
                continue
            answered[i] += 1
            if status == 503 and "retry-after" in headers:
                outcomes.append((time.monotonic() - started, "503+retry-after"))
            else:
                outcomes.append((time.monotonic() - started,
                                 str(status) if status == 200 else f"{status}: {raw[:200]!r}"))

    def ok_after(moment: float) -> int:
        return sum(1 for t, outcome in list(outcomes) if t > moment and outcome == "200")

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in clients:
        thread.start()
    try:
        # Under load: every client has had an answer, and goes on asking.
        try:
            wait_for(lambda: True if min(answered) >= 1 else None, KILL_WAIT_S,
                     "an answer for every client before the kill")
        except TimeoutError as exc:
            pytest.fail(f"{exc}: answers per client {answered}, outcomes {outcomes}")
        killed_at = time.monotonic() - started
        since = f"{time.time():.3f}"  # the proxy's log lines from the kill on (same host clock)
        scaled.compose.daemon.docker("kill", victim)  # SIGKILL: nothing is drained

        def routed_around() -> bool | None:
            if ok_after(killed_at) < 10:
                return None
            log = scaled.compose.daemon.docker("logs", "--since", since, proxy, timeout=30)
            return True if REPLICA_DOWN.search(log.stdout + log.stderr) else None

        try:
            wait_for(routed_around, KILL_WAIT_S,
                     "10 answers of 200 after the kill and the proxy logging the replica DOWN",
                     interval=1.0)
        except TimeoutError as exc:
            pytest.fail(f"{exc}: {ok_after(killed_at)} answered 200 after the kill; proxy log:\n"
                        f"{scaled.compose.logs('proxy', tail=40)}")
    finally:
        stop.set()
        for thread in clients:
            thread.join(CLIENT_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in clients), "a client hung"
    bad = [o for o in outcomes if o[1] not in ("200", "503+retry-after")]
    assert not bad, bad
    after = [o for o in outcomes if o[0] > killed_at]
    assert sum(1 for o in after if o[1] == "200") >= 10, outcomes
    # HAProxy saw the replica go, and what it retried on another one (its log's retries
    # field, `+N` when redispatched) is what clients did not have to retry themselves.
    proxy_log = scaled.compose.logs("proxy", tail=2000)
    assert REPLICA_DOWN.search(proxy_log), proxy_log
    retried = len(re.findall(r" \d+/\d+/\d+/\d+/\+?[1-9]\d* \d+/\d+ \"POST", proxy_log))
    print(f"{len(outcomes)} requests, {len(after)} after the kill at {killed_at:.1f} s: "
          f"{sum(1 for o in after if o[1] == '200')} answered 200, "
          f"{sum(1 for o in after if o[1] != '200')} 503 with Retry-After; "
          f"{retried} retried by the proxy")


def test_compose_stop_drains_a_stream_through_the_proxy(scaled) -> None:
    # Everything back (the `scaled` fixture: every replica healthy and routed to), then a
    # stream through HAProxy while the whole stack stops: compose stops the proxy first with
    # SIGUSR1 (soft stop: it stops listening and lets the stream finish), then the replicas
    # with SIGTERM (each drains).
    stream = Stream(f"{scaled.proxy}/v1/chat/completions",
                    chat_body("Tell me about rivers.", 64, stream=True, ignore_eos=True)).start()
    assert stream.first_chunk.wait(60), "no token within 60 s"
    scaled.compose.run("stop", timeout=180)
    events = stream.join(30)
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if "choices" in e]
    assert not [e for e in events[:-1] if "error" in e], events[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    (proxy,) = scaled.compose.containers("proxy")
    state = scaled.compose.inspect(proxy)["State"]
    assert state["Status"] == "exited" and not state["OOMKilled"]


@pytest.fixture
def unserved(scaled_stack: Scaled) -> Scaled:
    """The proxy running with every replica stopped (`docker-compose stop attnserve`). After
    the stop test before it in this file (the whole stack made and stopped) only the proxy's
    container is started again; after the kill test (the proxy up, one replica killed) only
    the stop runs: no need to bring replicas back and wait for them to be healthy only to
    stop them. In any other order (nothing made yet) the stack is brought up first."""
    compose = scaled_stack.compose

    def running(container: str) -> bool:
        return compose.inspect(container)["State"]["Running"] is True

    def proxy_running() -> bool:
        proxies = compose.containers("proxy")
        return len(proxies) == 1 and running(proxies[0])

    proxies = compose.containers("proxy")
    if len(proxies) == 1 and not running(proxies[0]) and len(
            compose.containers("attnserve")) == REPLICAS:
        compose.daemon.docker("start", proxies[0])
    elif not proxy_running():
        compose.up("-d", "--no-build", "--scale", f"attnserve={REPLICAS}", timeout=420)
        compose.wait_healthy("attnserve", REPLICAS, START_S)
    compose.run("stop", "--timeout", "20", "attnserve", timeout=120)
    assert proxy_running()
    assert not [c for c in compose.containers("attnserve")
                if compose.inspect(c)["State"]["Running"]]
    return scaled_stack


def test_the_proxy_answers_503_with_retry_after_when_no_replica_is_ready(unserved) -> None:
    scaled = unserved
    marker = uuid.uuid4().hex  # finds this request's line in the proxy's log
    status, headers, raw = post_json(f"{scaled.proxy}/v1/chat/completions?probe={marker}",
                                     chat_body("Anyone there?", 4), CLIENT_TIMEOUT_S)
    assert status == 503, raw[:300]
    assert headers.get("retry-after") == "2"
    assert json.loads(raw)["error_type"] == "unhealthy"
    # HAProxy's log line of this request (option httplog: backend/server, timers, status,
    # bytes, cookies, termination state, ..., request line): the proxy answered it itself
    # because it found no replica to pass it to, not a replica and not a hang (which
    # CLIENT_TIMEOUT_S would have ended with an error above). The termination state says
    # why: SC no server there (`<NOSRV>`, or the last one it tried refused), sC none
    # connected in time, sQ none came within `timeout queue`.
    answered = re.compile(r"attnserve/(<NOSRV>|attnserve\d+) \S+ 503 \d+ \S+ \S+ "
                          rf"(SC|sC|sQ)\S\S .*\"POST /v1/chat/completions\?probe={marker} ")

    def logged() -> str | None:  # HAProxy writes the line once the response is sent
        line = answered.search(scaled.compose.logs("proxy", tail=200))
        return line.group(0) if line else None

    try:
        wait_for(logged, 30, f"the proxy's log line of request {marker}", interval=1.0)
    except TimeoutError as exc:
        pytest.fail(f"{exc}: no line answered by the proxy itself (503 with SC, sC or sQ):\n"
                    f"{scaled.compose.logs('proxy', tail=40)}")
