"""An imported GPT-2 served over HTTP equals transformers: greedy /generate token for
token (concurrent requests sharing decode steps, no pad token), the stop at
<|endoftext|>, and /attention on GPT-2's 12 layers × 12 heads against
``output_attentions=True``.

The model is a random-weight GPT2LMHeadModel built by transformers (tests/hf_gpt2.py),
imported and exported with engine.onnx, which the server decodes with.
"""

from __future__ import annotations

import io as _io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.contract.engine_spec import ENGINE_MIXED_FILE
from tests.hf_gpt2 import ENDOFTEXT, load_hf_model
from tests.service.helpers import ServerProcess, serving

pytest.importorskip("transformers")

PROMPTS = ["Return the", "This module provides functions for", "If the",
           "Raise a ValueError when the argument is"]


@pytest.fixture(scope="module")
def server(gpt2_artifact: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    yield from serving(gpt2_artifact, tmp_path_factory.mktemp("gpt2-log") / "server.log")


@pytest.fixture(scope="module")
def reference(served_gpt2: Any) -> tuple[Any, Any]:
    """transformers' model (eager attention) and GPT2TokenizerFast on the same files."""
    from transformers import GPT2TokenizerFast

    torch.set_num_threads(1)
    return load_hf_model(served_gpt2.hf_dir), GPT2TokenizerFast.from_pretrained(
        str(served_gpt2.hf_dir))


def _hf_greedy(reference: tuple[Any, Any], text: str, max_new: int) -> list[int]:
    model, tok = reference
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)
    return [int(t) for t in out[0, ids.shape[1]:]]


def _generate(server: ServerProcess, text: str, max_new: int) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/generate", timeout=120, json={
        "inputs": text, "parameters": {"max_new_tokens": max_new, "details": True}})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_serves_gpt2_special_tokens_with_the_engine_graph(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/info", timeout=10).json()
    assert info["decode_graph"] == ENGINE_MIXED_FILE


def test_concurrent_greedy_generate_equals_transformers(
        server: ServerProcess, reference: tuple[Any, Any]) -> None:
    lengths = [14, 6, 20, 10]  # rows leave the shared batch at different steps
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = list(pool.map(lambda i: _generate(server, PROMPTS[i], lengths[i]),
                               range(len(PROMPTS))))
    _, tok = reference
    for text, n, body in zip(PROMPTS, lengths, bodies, strict=True):
        expected = _hf_greedy(reference, text, n)
        got = [t["id"] for t in body["details"]["tokens"]]
        assert got == expected, text
        assert body["generated_text"] == tok.decode(expected, skip_special_tokens=True)


def test_greedy_generation_stops_at_endoftext(
        server: ServerProcess, reference: tuple[Any, Any], served_gpt2: Any) -> None:
    _, tok = reference
    eos = tok.convert_tokens_to_ids(ENDOFTEXT)
    expected = _hf_greedy(reference, served_gpt2.stop_prompt, 30)
    assert len(expected) == served_gpt2.eos_step + 1 and expected[-1] == eos  # the reference
    body = _generate(server, served_gpt2.stop_prompt, 30)
    details = body["details"]
    assert [t["id"] for t in details["tokens"]] == expected
    assert details["finish_reason"] == "eos_token"
    assert details["generated_tokens"] == len(expected)
    assert details["tokens"][-1]["special"] is True
    assert ENDOFTEXT not in body["generated_text"]
    assert body["generated_text"] == tok.decode(expected, skip_special_tokens=True)


def test_attention_weights_equal_transformers_output_attentions(
        server: ServerProcess, reference: tuple[Any, Any]) -> None:
    model, tok = reference
    text = PROMPTS[3]
    r = httpx.post(f"{server.url}/attention", timeout=60,
                   json={"inputs": text, "format": "npz"})
    assert r.status_code == 200, r.text
    got = np.load(_io.BytesIO(r.content))
    ids = tok(text)["input_ids"]
    assert got["token_ids"].tolist() == ids
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    expected = np.stack([a[0].numpy() for a in attentions])  # (layers, heads, T, T)
    assert got["weights"].shape == expected.shape == (12, 12, len(ids), len(ids))
    np.testing.assert_allclose(got["weights"], expected, atol=1e-5)
