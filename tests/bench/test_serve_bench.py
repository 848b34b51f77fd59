"""`python -m benchmarks.serve` end to end against a real server on the tiny artifact.

A few requests per run, bounded; nothing about speed is asserted. What is asserted: every
request completed, the JSON carries vLLM's field names and agrees with what the server
itself counted (/metrics), the token lengths are the ones asked for, the concurrency cap
held, the /attention flood was answered, and the Markdown and PNG were written.

The server is the service tests' (tests/service/launch_server.py): it binds port 0 and
reports its port, and its attention gate lets the flood test hold the admitted /attention
request of each wave until the rest of the wave is refused, so how many are refused does
not depend on how fast the machine is.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve.__main__ import main
from tests.service.helpers import ServerProcess, metric_value

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VLLM_FIELDS = {"date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
               "burstiness", "max_concurrency", "duration", "completed", "failed",
               "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput",
               "max_output_tokens_per_s", "max_concurrent_requests", "input_lens",
               "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
               "errors"} | {f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99")
                            for m in ("ttft", "tpot", "itl", "e2el")}


@pytest.fixture(scope="module")
def server(tiny_artifact: Path, attention_gate: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve-bench") / "server.log"
    srv = ServerProcess(tiny_artifact, log, env={
        "ATTNSERVE_ATTENTION_MAX_CONCURRENT": "1", "ATTNSERVE_ATTENTION_MAX_QUEUED": "0",
        "ATTNSERVE_TEST_ATTENTION_GATE": str(attention_gate)})
    try:
        srv.wait_ready(120)
        yield srv
    finally:
        srv.stop()


def busy_refusals(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, "attnserve_rejected_requests_total",
                        {"reason": "attention_busy"})


class FloodReferee:
    """Lets each /attention request the server admits leave its attention session only
    once the rest of its wave (``wave - 1`` requests) has been refused, so a wave that
    reaches the server spread out on a busy machine is refused all the same."""

    def __init__(self, gate: Path, url: str, wave: int) -> None:
        self.gate, self.url, self.wave = gate, url, wave
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FloodReferee:
        self._start = busy_refusals(self.url)
        self._thread.start()
        return self

    def _run(self) -> None:
        held = 0
        while True:
            with open(self.gate / "entered", "rb") as entered:
                if not entered.read(1):
                    return  # __exit__ opened and closed it: the flood is over
            held += 1
            try:
                self._await_refusals(held)
            except Exception as exc:  # reported by the test; the request is let go anyway
                self.errors.append(f"wave {held}: {exc!r}")
            finally:
                with open(self.gate / "release", "w") as release:
                    release.write("1")

    def _await_refusals(self, waves: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (refused := busy_refusals(self.url)) < self._start + (self.wave - 1) * waves:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{refused - self._start:.0f} refused in {timeout} s")
            time.sleep(0.02)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        deadline = time.monotonic() + 30
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:  # an empty write wakes the thread waiting for the next request
                os.close(os.open(self.gate / "entered", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: the thread is not waiting yet
                time.sleep(0.01)
            self._thread.join(0.1)
        if self._thread.is_alive():
            self.errors.append("the referee did not stop")


def generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "attnserve_generation_tokens_total":
                return float(sample.value)
    raise AssertionError("no attnserve_generation_tokens_total")


def runs(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def test_random_workload_over_generate_stream(server: ServerProcess, tiny_artifact: Path,
                                              tmp_path: Path) -> None:
    before = generated_tokens(server.url)
    code = main(["--url", server.url, "--model", str(tiny_artifact), "--workload", "random",
                 "--input-len", "24", "--output-len", "8", "--num-prompts", "5",
                 "--request-rate", "100,inf", "--num-warmups", "0",
                 "--goodput", "ttft:600000", "e2el:600000", "--result-dir", str(tmp_path)])
    assert code == 0
    results = runs(tmp_path)
    assert [r["request_rate"] for r in sorted(results, key=lambda r: r["request_rate"])] == [
        100.0, float("inf")]
    for run in results:
        assert set(run) >= VLLM_FIELDS, sorted(VLLM_FIELDS - set(run))
        assert (run["completed"], run["failed"]) == (5, 0), run["errors"]
        assert run["input_lens"] == [24] * 5  # the server's count of each prompt
        assert all(1 <= n <= 8 for n in run["output_lens"])
        assert run["total_output_tokens"] == sum(run["output_lens"])
        # One SSE event per token: every token but the first has an inter-token gap.
        assert [len(g) for g in run["itls"]] == [n - 1 for n in run["output_lens"]]
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        assert run["output_throughput"] == pytest.approx(
            run["total_output_tokens"] / run["duration"])
    # The server generated exactly the tokens the client counted.
    assert generated_tokens(server.url) - before == sum(r["total_output_tokens"]
                                                        for r in results)
    md = (tmp_path / "report.md").read_text()
    assert md.count("| random |") == 2 and "ttft ≤ 600000 ms" in md
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG_MAGIC


def test_shared_prefix_over_openai_with_a_cap_and_an_attention_flood(
        server: ServerProcess, attention_gate: Path, tiny_artifact: Path,
        tmp_path: Path) -> None:
    with FloodReferee(attention_gate, server.url, wave=3) as referee:
        code = main(["--url", server.url, "--model", str(tiny_artifact), "--backend", "openai",
                     "--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "40",
                     "--suffix-len", "8", "--output-len", "6", "--num-prompts", "6",
                     "--request-rate", "50", "--max-concurrency", "2", "--num-warmups", "1",
                     "--attention-flood", "3", "--attention-input-len", "16",
                     "--result-dir", str(tmp_path), "--label", "smoke"])
    assert not referee.errors, referee.errors
    assert code == 0
    (run,) = runs(tmp_path)
    assert (tmp_path / "smoke-openai-shared-prefix-rate50.json").is_file()
    assert (run["completed"], run["failed"]) == (6, 0), run["errors"]
    assert run["max_concurrent_requests"] <= 2
    assert all(46 <= n <= 50 for n in run["input_lens"]), run["input_lens"]
    assert all(1 <= n <= 6 for n in run["output_lens"])
    flood = run["attention_flood"]
    # One /attention slot and no queue: of each wave of 3, at least 2 are refused.
    assert flood["sent"] >= 3 and flood["ok"] + flood["rejected"] == flood["sent"]
    assert flood["ok"] >= 1 and flood["rejected"] >= 2 and not flood["other"]
    assert "/attention flood of 3" in (tmp_path / "report.md").read_text()


def metric_total(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no {name}")


def test_chat_workload_renders_the_models_template_and_shares_its_prefix(
        server: ServerProcess, tiny_artifact: Path, tmp_path: Path) -> None:
    """Two-turn chats: one system prompt for all, second turns extend their first turns,
    and over HTTP the server's prefix cache reuses the shared part."""
    from benchmarks.serve.workloads import chat_requests
    from service.artifact.text import TextCodec

    codec = TextCodec.from_file(tiny_artifact / "tokenizer.json")
    rendered: list[list[dict[str, str]]] = []

    def render(messages: list[dict[str, str]]) -> str:
        rendered.append([dict(m) for m in messages])
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    requests = chat_requests(codec, render, 5, 1, 40, 8, 6)
    assert len(requests) == 5 and [len(m) for m in rendered] == [2, 4, 2, 4, 2]
    first, second = requests[:3], requests[3:]
    for a, b in zip(first, second, strict=False):  # a second turn extends its first turn
        assert b.prompt.startswith(a.prompt.removesuffix("<assistant>"))
    assert len({m[0]["content"] for m in rendered}) == 1  # one system prompt for all

    hits = metric_total(server.url, "attnserve_prefix_cache_hits_total")
    code = main(["--url", server.url, "--model", str(tiny_artifact), "--workload", "chat",
                 "--num-prefixes", "1", "--prefix-len", "8", "--suffix-len", "2",
                 "--output-len", "2", "--num-prompts", "6", "--request-rate", "inf",
                 "--max-concurrency", "1", "--num-warmups", "0",
                 "--result-dir", str(tmp_path)])
    (run,) = runs(tmp_path)
    assert (run["completed"], run["failed"]) == (6, 0), run["errors"]
    assert code == 0
    # Every prompt holds the 8-token system prompt, the user turn and the markup.
    assert all(n > 8 + 2 for n in run["input_lens"]), run["input_lens"]
    assert metric_total(server.url, "attnserve_prefix_cache_hits_total") > hits


def test_long_prompt_joins_are_sent_answered_and_split_from_steady_gaps(
        server: ServerProcess, tiny_artifact: Path, tmp_path: Path) -> None:
    """--long-join-interval: prompts of --long-join-len tokens join while the load runs; each
    is answered (one new token each, as the server counts), and the streams' gaps are split
    into those overlapping a join and the rest, which together are all of them."""
    before = generated_tokens(server.url)
    code = main(["--url", server.url, "--model", str(tiny_artifact), "--backend", "openai",
                 "--ignore-eos", "--input-len", "16", "--output-len", "100",
                 "--num-prompts", "6", "--max-concurrency", "1", "--num-warmups", "0",
                 "--long-join-interval", "0.02",
                 "--long-join-count", "2", "--long-join-len", "40",
                 "--result-dir", str(tmp_path)])
    assert code == 0
    (run,) = runs(tmp_path)
    joins = run["long_prompt_joins"]
    assert joins["failed"] == [] and joins["prompt_len"] == 40
    assert 1 <= joins["joins"] == len(joins["windows"]) <= 2
    assert all(0 < sent < answered for sent, answered in joins["windows"])
    assert joins["gaps_during"] + joins["gaps_steady"] == sum(len(g) for g in run["itls"])
    assert generated_tokens(server.url) - before == run["total_output_tokens"] + joins["joins"]
    assert run["host"]["client_cpu_s"] > 0  # the client's own share of the machine


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "x", "--goodput", "itl:5"], "--goodput"),
    (["--workload", "random"], "--url"),
    (["--url", "http://127.0.0.1:9", "--model", "/nonexistent"], "no tokenizer"),
    (["--url", "http://127.0.0.1:9", "--model", "x", "--ignore-eos"], "--backend openai"),
    (["--url", "http://127.0.0.1:9", "--tokenizer", "t.json", "--static-baseline"],
     "give --model"),
    (["--model", "x", "--static-baseline", "--adapters", "a,"], "leave out --adapters"),
    (["--model", "x", "--adapters", "a,b,", "--num-prompts", "2"], "--num-prompts"),
    (["--url", "http://127.0.0.1:9", "--tokenizer", "t.json", "--lora-modules", "a=b"],
     "--lora-modules"),
])
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("benchmarks.serve: error:") and message in err
    assert len(err.splitlines()) == 1


def test_static_baseline_runs_the_same_requests_beside_the_continuous_run(
        server: ServerProcess, tiny_artifact: Path, tmp_path: Path) -> None:
    """--ignore-eos: every request yields exactly --output-len tokens over HTTP, and the
    in-process static reference (batches of --max-concurrency, before and after) generates
    the same total; the ratio is the two throughputs' quotient (its value is not asserted)."""
    code = main(["--url", server.url, "--model", str(tiny_artifact), "--backend", "openai",
                 "--ignore-eos", "--input-len", "16", "--output-len", "12", "--num-prompts", "6",
                 "--max-concurrency", "4", "--num-warmups", "0", "--static-baseline",
                 "--result-dir", str(tmp_path)])
    assert code == 0
    (run,) = runs(tmp_path)
    assert run["ignore_eos"] is True and run["output_lens"] == [12] * 6
    static = run["static_baseline"]
    assert (static["batch"], static["batches"], static["ignore_eos"]) == (4, 2, True)
    assert [r["output_tokens"] for r in static["runs"]] == [6 * 12, 6 * 12]
    mean = sum(r["output_throughput"] for r in static["runs"]) / 2
    assert static["output_throughput"] == pytest.approx(mean)
    assert static["continuous_vs_static"] == pytest.approx(run["output_throughput"] / mean)
    assert "static batches of 4" in (tmp_path / "report.md").read_text()


def test_a_server_that_is_not_there_exits_2_with_one_line(
        tiny_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port bound here but not listening refuses connections (whatever else runs on the
    machine): the connection error is one line, and no result is written."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        assert main(["--url", f"http://{address}", "--model", str(tiny_artifact),
                     "--num-prompts", "1", "--result-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("benchmarks.serve: error:") and len(err.splitlines()) == 1
    assert address in err
    assert not list(tmp_path.glob("*.json"))


def test_rounds_measure_the_static_reference_between_them_and_report_the_median(
        server: ServerProcess, tiny_artifact: Path, tmp_path: Path) -> None:
    """--rounds 2 --static-baseline: two runs (one JSON each), three static measurements
    (before, between, after), each round's ratio against the two around it, and the median
    of the rounds' ratios in report.md."""
    code = main(["--url", server.url, "--model", str(tiny_artifact), "--backend", "openai",
                 "--ignore-eos", "--input-len", "16", "--output-len", "8", "--num-prompts", "4",
                 "--max-concurrency", "4", "--num-warmups", "0", "--static-baseline",
                 "--rounds", "2", "--result-dir", str(tmp_path)])
    assert code == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == ["openai-random-rateinf-round1.json", "openai-random-rateinf-round2.json"]
    first, second = (json.loads((tmp_path / name).read_text()) for name in names)
    assert (first["round"], second["round"]) == (1, 2)
    assert first["output_lens"] == second["output_lens"] == [8] * 4
    # The measurement between the rounds closes round 1 and opens round 2.
    assert first["static_baseline"]["runs"][1] == second["static_baseline"]["runs"][0]
    assert first["static_baseline"]["runs"][0] != second["static_baseline"]["runs"][1]
    ratios = []
    for run in (first, second):
        static = run["static_baseline"]
        assert [r["output_tokens"] for r in static["runs"]] == [32, 32]
        mean = float(np.mean([r["output_throughput"] for r in static["runs"]]))
        assert static["continuous_vs_static"] == pytest.approx(run["output_throughput"] / mean)
        ratios.append(run["output_throughput"] / mean)
    md = (tmp_path / "report.md").read_text()
    assert f"median of 2 rounds: {float(np.median(ratios)):.3f}×" in md
    assert "| inf, round 1 |" in md and "| inf, round 2 |" in md
