"""generation_config.json sampling defaults on the OpenAI routes (vLLM's
``--generation-config auto``), against transformers ``generate`` with the same settings.

The Llama test artifact is copied and given a generation_config.json with top_k 1 (so
sampling at the API's default temperature 1 is greedy), repetition_penalty 1.5 and
max_new_tokens 7; the manifest is re-pinned with the project's own writer, as an export
would have written it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from service.artifact.generation_defaults import GenerationDefaults, parse_generation_defaults
from service.contract import io_spec as io
from service.contract.manifest import describe_files, load_manifest
from tests.hf_llama import load_hf_model

PROMPT = "Open the file and read"
AUTHOR = {"top_k": 1, "repetition_penalty": 1.5, "max_new_tokens": 7}


def test_values_equal_to_transformers_defaults_count_as_unset() -> None:
    parsed = parse_generation_defaults({"do_sample": True, "temperature": 1.0, "top_p": 1.0,
                                        "top_k": 50, "repetition_penalty": 1.0,
                                        "eos_token_id": [2, 0]})
    assert parsed == GenerationDefaults()
    qwen = parse_generation_defaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                      "repetition_penalty": 1.05})
    assert qwen.to_dict() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                              "repetition_penalty": 1.05}


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("top_p", 0), ("top_k", -2),
                                         ("min_p", "0.1"), ("max_new_tokens", 0),
                                         ("repetition_penalty", True)])
def test_values_the_api_would_refuse_stop_the_start_naming_the_field(field: str,
                                                                      value: Any) -> None:
    with pytest.raises(ValueError, match=f"generation_config.json: {field} .*"
                                         "--generation-config off"):
        parse_generation_defaults({field: value})


@pytest.fixture(scope="module")
def built(llama_artifacts: Any) -> Any:
    return llama_artifacts("llama")


@pytest.fixture(scope="module")
def artifact(built: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama artifact with the author's defaults in its generation_config.json."""
    out = tmp_path_factory.mktemp("gen-defaults") / "artifact"
    shutil.copytree(built.artifact, out)
    path = out / io.GENERATION_CONFIG_FILE
    config = json.loads(path.read_text("utf-8"))
    path.write_text(json.dumps({**config, **AUTHOR}), "utf-8")
    manifest = load_manifest(out)
    manifest.files.update(describe_files(out, [io.GENERATION_CONFIG_FILE]))
    manifest.write(out)
    return out


@pytest.fixture(scope="module")
def hf(built: Any) -> Any:
    torch.set_num_threads(1)
    return load_hf_model(built.hf_dir)


@pytest.fixture(scope="module")
def client(start_server: Callable[..., Any]) -> Iterator[httpx.Client]:
    server = start_server("--max-batch-size", "2")
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _hf_text(hf: Any, artifact: Path, max_new: int, repetition_penalty: float) -> str:
    """transformers' greedy generate (what top_k 1 sampling is) on the prompt's ids."""
    tok = Tokenizer.from_file(str(artifact / io.TOKENIZER_FILE))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                          dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False,
                          repetition_penalty=repetition_penalty,
                          pad_token_id=eos[0] if isinstance(eos, list) else eos)
    return str(tok.decode([int(t) for t in out[0, len(ids):]], skip_special_tokens=True))


def _complete(client: httpx.Client, **fields: Any) -> dict[str, Any]:
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "seed": 3,
                                             **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_info_shows_the_defaults(client: httpx.Client) -> None:
    assert client.get("/info").json()["generation_defaults"] == AUTHOR


def test_unset_fields_take_the_authors_values(client: httpx.Client, hf: Any,
                                              artifact: Path) -> None:
    body = _complete(client)  # no temperature (1), no top_k, no penalty, no max_tokens
    expected = _hf_text(hf, artifact, AUTHOR["max_new_tokens"], AUTHOR["repetition_penalty"])
    assert body["choices"][0]["text"] == expected
    assert body["usage"]["completion_tokens"] <= AUTHOR["max_new_tokens"]


def test_fields_the_request_sets_win(client: httpx.Client, hf: Any, artifact: Path) -> None:
    body = _complete(client, repetition_penalty=1.0, max_tokens=5, temperature=0)
    assert body["choices"][0]["text"] == _hf_text(hf, artifact, 5, 1.0)


def test_chat_takes_the_defaults_too(client: httpx.Client) -> None:
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "seed": 3,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == AUTHOR["max_new_tokens"]


def test_tgi_routes_do_not_read_the_file(client: httpx.Client, hf: Any,
                                         artifact: Path) -> None:
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6}})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == _hf_text(hf, artifact, 6, 1.0)


def test_off_serves_the_api_defaults(start_server: Callable[..., Any], hf: Any,
                                     artifact: Path) -> None:
    server = start_server("--max-batch-size", "2", "--generation-config", "off")
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.get("/info").json()["generation_defaults"] == {}
        body = _complete(c, temperature=0, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
        body = _complete(c, temperature=0)  # and no repetition penalty
        assert body["choices"][0]["text"] == _hf_text(hf, artifact, 16, 1.0)
