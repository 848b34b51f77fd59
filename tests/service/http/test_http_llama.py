"""Llama and Qwen2 artifacts served over HTTP, against transformers.

Random-weight models built locally with transformers (tests/hf_llama.py) are imported,
exported and served by `attnserve serve` (torch hidden), decoding with engine_mixed.onnx
(the default: GroupQueryAttention, in-place cache, mixed steps), engine.onnx
(`--no-mixed-steps`) and model.onnx; greedy text must equal
transformers' ``generate(do_sample=False)`` and /attention must equal its
``output_attentions`` in eager attention, per query head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from service.contract import io_spec as io
from tests.hf_llama import load_hf_model

PROMPTS = ["Return the", "The attention weights of a query", "x", "Open the file and read"]
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=[("llama", "engine_mixed.onnx"), ("llama", "model.onnx"),
                                        ("qwen2", "engine.onnx"), ("qwen2", "model.onnx"),
                                        ("qwen3", "engine_mixed.onnx"),
                                        ("smollm3", "engine_mixed.onnx"),
                                        ("mistral", "engine_mixed.onnx"),
                                        ("mistral", "model.onnx"),
                                        ("phi3", "engine_mixed.onnx"),
                                        ("gemma3", "engine_mixed.onnx"),
                                        ("gemma3", "model.onnx")],
                ids=lambda p: "-".join(p))
def served(request: pytest.FixtureRequest, llama_artifacts: Any) -> tuple[Any, str]:
    """(build, decode graph): the families through both of the service's decode paths."""
    family, graph = request.param
    return llama_artifacts(family), graph


@pytest.fixture(scope="module")
def built(served: tuple[Any, str]) -> Any:
    return served[0]


@pytest.fixture(scope="module")
def artifact(built: Any) -> Path:
    """Overrides tests/service/conftest.py's: start_server serves this artifact."""
    return Path(built.artifact)


@pytest.fixture(scope="module")
def hf(built: Any) -> Any:
    torch.set_num_threads(1)
    return load_hf_model(built.hf_dir)


@pytest.fixture(scope="module")
def client(start_server: Callable[..., Any], served: tuple[Any, str]
           ) -> Iterator[httpx.Client]:
    graph = served[1]
    flags = {"engine_mixed.onnx": ["--engine-graph"],
             "engine.onnx": ["--engine-graph", "--no-mixed-steps"]}.get(graph,
                                                                      ["--no-engine-graph"])
    server = start_server("--max-batch-size", "4", *flags)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.get("/info").json()["decode_graph"] == graph
        yield c


def _hf_greedy(hf: Any, ids: list[int], max_new: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy generate with the model's own generation_config.json (both
    stop ids: <|im_end|> and <|endoftext|>); the stop token is kept, as the server does."""
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                          dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False,
                          pad_token_id=eos[0] if isinstance(eos, list) else eos)
    return [int(t) for t in out[0, len(ids):]]


def test_greedy_over_http_equals_transformers_generate(client: httpx.Client, hf: Any,
                                                       artifact: Path) -> None:
    """Concurrent requests (batched, left-padded in the engine) each equal HF alone."""
    tok = Tokenizer.from_file(str(artifact / io.TOKENIZER_FILE))

    def ask(prompt: str) -> dict[str, Any]:
        r = client.post("/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": NEW_TOKENS, "details": True}})
        assert r.status_code == 200, r.text
        return dict(r.json())

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    for prompt, body in zip(PROMPTS, answers, strict=True):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        expected = _hf_greedy(hf, ids)
        assert [t["id"] for t in body["details"]["tokens"]] == expected
        assert body["generated_text"] == tok.decode(expected, skip_special_tokens=True)


def test_chat_completion_uses_the_models_template_like_apply_chat_template(
        client: httpx.Client, hf: Any, built: Any) -> None:
    """The artifact's own template (tokenizer_config.json for llama, chat_template.jinja
    for qwen2) renders what transformers' apply_chat_template renders; greedy replies equal
    generate on those ids."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(built.hf_dir))
    messages = [{"role": "user", "content": "Open the file and read"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = _hf_greedy(hf, list(ids), 12)
    r = client.post("/v1/chat/completions", json={
        "model": client.get("/v1/models").json()["data"][0]["id"], "messages": messages,
        "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["message"]["content"] == hf_tok.decode(
        expected, skip_special_tokens=True)
    rendered = client.post("/tokenize", json={"messages": messages}).json()
    assert rendered["tokens"] == list(ids)


def test_attention_per_query_head_equals_transformers(client: httpx.Client, hf: Any,
                                                      artifact: Path) -> None:
    config = io.ArtifactConfig.load(artifact)
    text = "The attention weights of a query"
    r = client.post("/attention", json={"inputs": text, "include": ["weights", "k", "v"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["kv_heads"] == [0, 0, 1, 1]  # 4 query heads share 2 key/value heads
    ids = [t["id"] for t in body["tokens"]]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_attentions=True).attentions
    weights = np.asarray(body["attention"]["weights"])  # (layers, heads, T, T)
    assert weights.shape == (config.n_layers, config.n_heads, len(ids), len(ids))
    for layer, want in enumerate(ref):
        np.testing.assert_allclose(weights[layer], want[0].numpy(), atol=1e-5)
    k, v = np.asarray(body["attention"]["k"]), np.asarray(body["attention"]["v"])
    assert np.array_equal(k[:, 0], k[:, 1]) and np.array_equal(v[:, 2], v[:, 3])
    assert not np.array_equal(k[:, 1], k[:, 2])
    some = client.post("/attention", json={"inputs": text, "heads": [3, 0]}).json()
    assert some["kv_heads"] == [1, 0]


def test_prompts_get_what_the_tokenizer_post_processor_adds(tmp_path: Path) -> None:
    """A tokenizer that prepends a BOS (TinyLlama's ``<s>``) gets it, as in transformers'
    ``tokenizer(text)``; a rendered chat template is encoded without additions."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from service.artifact.text import TextCodec
    from tests.hf_llama import IM_START, write_tokenizer

    ids = write_tokenizer(tmp_path, "llama")
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{IM_START} $A", special_tokens=[(IM_START, ids[IM_START])])
    text = "Open the file and read"
    expected = PreTrainedTokenizerFast(tokenizer_object=tok)(text)["input_ids"]
    codec = TextCodec(tok)
    assert codec.encode(text) == expected and expected[0] == ids[IM_START]
    assert codec.encode(text, add_special_tokens=False) == expected[1:]
