"""The LoRA benchmarks' own parts, without a model: the random PEFT adapters
(benchmarks/lora_adapters.py) read back as the server reads them, the serving benchmark's
adapter spread and what each request sends, the soak's answer check
(benchmarks/lora_soak.py), and what the client's requests read for the soaks and the other
benchmarks (benchmarks/serve/client.py). Nothing about speed or memory is asserted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from benchmarks.lora_adapters import adapter_widths, write_adapter
from benchmarks.lora_soak import Reference, compare, top2_margin
from benchmarks.serve import client as load
from benchmarks.serve.__main__ import _adapter_spread, adapter_counts
from benchmarks.serve.workloads import SampleRequest, spread_adapters
from service.contract.peft_adapter import WEIGHTS_FILE
from service.engine.adapters import read_adapter_weights

WIDTHS = {"model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.self_attn.k_proj": (8, 4),
          "model.layers.0.mlp.down_proj": (12, 8)}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def serve(routes: dict[str, Handler], run: Callable[[aiohttp.ClientSession], Awaitable[None]]
          ) -> None:
    """``run`` with a client of a loopback server answering POSTs to ``routes``."""
    async def main() -> None:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with load.session(f"http://127.0.0.1:{port}") as client:
                await run(client)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_random_adapter_reads_back_as_the_server_reads_it(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", WIDTHS, rank=4, seed=1)
    weights = read_adapter_weights(path, "a", WIDTHS, max_rank=16)
    assert weights.rank == 4 and set(weights.modules) == set(WIDTHS)
    for module, (a, b) in weights.modules.items():
        width_in, width_out = WIDTHS[module]
        assert a.shape == (4, width_in) and b.shape == (4, width_out)
        assert np.abs(a).max() <= 1 / np.sqrt(width_in)  # PEFT's kaiming_uniform_(a=√5)
        assert 0 < np.abs(b).max() < 1  # B small, not PEFT's zeros: the adapter does something
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no temporary left behind


def test_an_existing_adapter_is_replaced_only_when_forced(tmp_path: Path) -> None:
    write_adapter(tmp_path / "a", WIDTHS, rank=2, seed=1)
    first = (tmp_path / "a" / WEIGHTS_FILE).read_bytes()
    with pytest.raises(FileExistsError):
        write_adapter(tmp_path / "a", WIDTHS, rank=2, seed=2)
    write_adapter(tmp_path / "a", WIDTHS, rank=2, seed=2, force=True)
    assert (tmp_path / "a" / WEIGHTS_FILE).read_bytes() != first
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_an_artifact_without_the_adapter_graph_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"engine_mixed_lora\.onnx"):
        adapter_widths(tmp_path)


def test_the_spread_is_round_robin_with_empty_entries_the_base() -> None:
    spread = _adapter_spread("a,b,")
    assert spread == ["a", "b", None]
    requests = spread_adapters([SampleRequest(f"p{i}", 1, 2) for i in range(7)], spread)
    assert [r.adapter for r in requests] == ["a", "b", None, "a", "b", None, "a"]
    outputs = [load.RequestOutput(success=i != 3, output_tokens=2) for i in range(7)]
    counts = adapter_counts(spread, requests, outputs, duration=2.0)
    assert counts["per_adapter"] == [
        {"adapter": "a", "requests": 3, "completed": 2, "failed": 1, "output_tokens": 4,
         "output_throughput": 2.0},
        {"adapter": "b", "requests": 2, "completed": 2, "failed": 0, "output_tokens": 4,
         "output_throughput": 2.0},
        {"adapter": None, "requests": 2, "completed": 2, "failed": 0, "output_tokens": 4,
         "output_throughput": 2.0}]


def test_each_backend_names_the_adapter_where_its_api_takes_it() -> None:
    """OpenAI's ``model`` (the base's name for a base request), TGI's
    ``parameters.adapter_id`` (absent for the base)."""
    bodies: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event = ({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1,
                                                       "completion_tokens": 1}}
                 if request.path.startswith("/v1") else
                 {"token": {"id": 1, "text": "x"}, "generated_text": "x",
                  "details": {"input_length": 1}})
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
        return response

    async def run(client: aiohttp.ClientSession) -> None:
        for backend in load.BACKENDS:
            send = load.request_func(backend, "base")
            for adapter in ("sql", None):
                req = SampleRequest("hi", 1, 2, adapter=adapter)
                assert (await send(client, req, load.RequestOutput())).success

    serve({"/v1/completions": answer, "/generate_stream": answer}, run)
    tgi = [b["parameters"].get("adapter_id") for b in bodies if "parameters" in b]
    openai = [b["model"] for b in bodies if "model" in b]
    assert tgi == ["sql", None] and openai == ["sql", "base"]


def test_an_answer_may_part_from_its_reference_only_at_a_near_tie() -> None:
    ref = Reference(["The", " cat", " sat", "."], [2.0, 0.01, 1.5, 3.0], "stop")
    assert compare(ref, ["The", " cat", " sat", "."], 0.05) == ("same", None, None)
    assert compare(ref, ["The", " dog", " ran"], 0.05) == ("near_tie", 1, 0.01)
    assert compare(ref, ["The", " cat", " ran"], 0.05) == ("wrong", 2, 1.5)
    assert compare(ref, ["The", " cat"], 0.05) == ("wrong", 2, 1.5)  # stopped early
    assert compare(ref, ["The", " cat", " sat", ".", " It"], 0.05)[0] == "wrong"  # no margin
    assert top2_margin({"top_logprobs": [{"logprob": -2.5}, {"logprob": -0.5}]}) == 2.0
    assert top2_margin({"top_logprobs": [{"logprob": -0.5}]}) is None


def test_the_other_benchmarks_requests_read_what_they_check() -> None:
    """A chat answer (whole or streamed: text, finish reason, logprobs; an error event), TGI's
    /generate (the generated tokens from the header, else the details), a plain-text POST;
    a refused request is an output, never an exception."""
    entries: list[dict[str, Any]] = [{"token": t, "logprob": -0.1, "top_logprobs": []}
                                     for t in ("Par", "is")]

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["model"] == "empty":
            return web.json_response({})
        if not body.get("stream"):
            return web.json_response({"choices": [{
                "message": {"content": "Paris"}, "finish_reason": "stop",
                "logprobs": {"content": entries}}], "usage": {"completion_tokens": 2}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events: list[dict[str, Any]] = [
            {"choices": [{"delta": {"content": e["token"]}, "logprobs": {"content": [e]},
                          "finish_reason": None}]} for e in entries]
        events.append({"choices": [{"delta": {}, "finish_reason": "length"}]})
        if body["model"] == "broken":
            events.append({"error": "engine stopped"})
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        headers = {"x-prompt-tokens": "3"}
        if body["inputs"] == "with header":
            headers["x-generated-tokens"] = "5"
        return web.json_response({"generated_text": "x", "details": {"generated_tokens": 4}},
                                 headers=headers)

    async def adapter(request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        return web.Response(text="Success", status=200 if name == "known" else 404)

    async def run(client: aiohttp.ClientSession) -> None:
        whole = await load.chat_request(client, {"model": "m"}, load.RequestOutput())
        assert (whole.success, whole.generated_text, whole.finish_reason, whole.output_tokens,
                [e["token"] for e in whole.logprobs]) == (True, "Paris", "stop", 2, ["Par", "is"])
        stream = await load.chat_request(client, {"model": "m", "stream": True},
                                         load.RequestOutput())
        assert (stream.success, stream.generated_text, stream.finish_reason,
                stream.logprobs) == (True, "Paris", "length", entries)
        assert stream.ttft > 0 and len(stream.itl) == 1
        broken = await load.chat_request(client, {"model": "broken", "stream": True},
                                         load.RequestOutput())
        assert not broken.success and broken.status == 200
        assert broken.error == "error event in the stream: engine stopped"
        counted = [await load.generate_request(client, SampleRequest(text, 0, 8),
                                               load.RequestOutput())
                   for text in ("with header", "without")]
        assert [(o.output_tokens, o.prompt_len) for o in counted] == [(5, 3), (4, 3)]
        loaded = await load.post(client, "/v1/load_lora_adapter", {"lora_name": "known"})
        assert (loaded.success, loaded.status, loaded.body) == (True, 200, "Success")
        missing = await load.post(client, "/v1/load_lora_adapter", {"lora_name": "other"})
        assert (missing.success, missing.status, missing.error) == (False, 404, "HTTP 404: Success")
        malformed = await load.send_one(client, load.chat_request, {"model": "empty"})
        assert not malformed.success and malformed.error.startswith("KeyError")

    serve({"/v1/chat/completions": chat, "/generate": generate,
           "/v1/load_lora_adapter": adapter}, run)
