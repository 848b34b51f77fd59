"""/attention's logit_lens, head_attribution and residual_norms over HTTP.

One `attnserve serve` of the tiny artifact, one of a copy whose attention.onnx predates the
members (the same graph cut to the attention maps, its manifest re-pinned). The reference
is the tiny PyTorch model: its residuals by forward hooks, put through its own head; the
attribution's terms must add up to its logit. The graph's own agreement with PyTorch, term
by term and family by family, is tests/export/test_attention_lens.py's.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.manifest import FileEntry, load_manifest, sha256_file
from service.viz.graph_cut import cut

TEXT = "First Citizen:\nBefore we"


@pytest.fixture(scope="module")
def client(start_server: Callable[..., Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=start_server().url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def gpt(tiny_checkpoint: Path) -> GPT:
    return load_checkpoint(tiny_checkpoint).model.eval()


def _residuals(gpt: GPT, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each block's output (T, d) and the logits (T, V), by forward hooks."""
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, a, out: seen.append(out[0][0]))
             for b in gpt.blocks]
    with torch.no_grad():
        logits = gpt(torch.tensor([ids])).logits[0]
    for hook in hooks:
        hook.remove()
    return seen, logits


def test_logit_lens_and_norms_are_the_torch_heads_of_each_residual(
        client: httpx.Client, gpt: GPT, encode: Callable[[str], list[int]]) -> None:
    ids = encode(TEXT)
    r = client.post("/attention", json={"inputs": TEXT, "include": [
        "logit_lens", "residual_norms"], "top_k": 4, "target": 5, "layers": [1, 0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["attention"] == {} and body["layers"] == [1, 0]
    lens, norms = body["logit_lens"], np.asarray(body["residual_norms"])
    residuals, _ = _residuals(gpt, ids)
    for row, layer in enumerate([1, 0]):
        with torch.no_grad():
            probs = torch.softmax(gpt.head(residuals[layer]).double(), -1)  # (T, V)
        want_p, want_ids = probs.topk(4, -1)
        np.testing.assert_allclose(np.asarray(lens["top_probs"][row]), want_p.numpy(),
                                   atol=1e-5)
        assert lens["top_ids"][row][-1] == want_ids[-1].tolist()
        np.testing.assert_allclose(lens["target_probs"][row], probs[:, 5].numpy(), atol=1e-6)
        want_rank = (probs > probs[:, 5:6]).sum(-1).tolist()
        assert lens["target_ranks"][row] == want_rank
        np.testing.assert_allclose(norms[row], residuals[layer].norm(dim=-1).numpy(),
                                   rtol=1e-5)
    assert len(lens["top_tokens"][0][0]) == 4 and all(isinstance(t, str)
                                                      for t in lens["top_tokens"][0][0])


def test_head_attribution_adds_up_to_the_torch_logit(
        client: httpx.Client, gpt: GPT, encode: Callable[[str], list[int]]) -> None:
    ids = encode(TEXT)
    _, logits = _residuals(gpt, ids)
    for position, target in ((None, None), (3, 7)):
        body: dict[str, Any] = {"inputs": TEXT, "include": ["head_attribution"]}
        body |= {} if position is None else {"position": position, "target": target}
        r = client.post("/attention", json=body)
        assert r.status_code == 200, r.text
        got = r.json()["head_attribution"]
        at = len(ids) - 1 if position is None else position
        want_target = int(logits[at].argmax()) if target is None else target
        assert (got["position"], got["target"]) == (at, want_target)
        cfg = gpt.config
        heads = np.asarray(got["heads"])
        assert heads.shape == (cfg.n_layers, cfg.n_heads)
        np.testing.assert_allclose(got["attention"], heads.sum(1), atol=1e-5)
        total = (got["embedding"] + heads.sum() + sum(got["attention_bias"]) +
                 sum(got["mlp"]) + sum(got["mlp_bias"]) + got["norm_bias"])
        assert total == pytest.approx(float(logits[at, want_target]), abs=1e-3)
        assert got["logit"] == pytest.approx(float(logits[at, want_target]), abs=1e-4)


def test_npz_carries_the_same_values_and_old_members_are_unchanged(
        client: httpx.Client) -> None:
    members = {"inputs": TEXT, "include": ["weights", "logit_lens", "head_attribution",
                                           "residual_norms"], "top_k": 3}
    as_json = client.post("/attention", json=members).json()
    archive = np.load(BytesIO(client.post("/attention", json=members | {"format": "npz"})
                              .content), allow_pickle=False)
    np.testing.assert_array_equal(archive["logit_lens.top_ids"],
                                  as_json["logit_lens"]["top_ids"])
    np.testing.assert_allclose(archive["logit_lens.top_probs"],
                               as_json["logit_lens"]["top_probs"], rtol=1e-6)
    np.testing.assert_allclose(archive["residual_norms"], as_json["residual_norms"], rtol=1e-6)
    np.testing.assert_allclose(archive["head_attribution.heads"],
                               as_json["head_attribution"]["heads"], rtol=1e-6)
    assert int(archive["head_attribution.target"]) == as_json["head_attribution"]["target"]
    # the maps of the same pass are the maps asked alone, and the old body is unchanged
    alone = client.post("/attention", json={"inputs": TEXT}).json()
    np.testing.assert_allclose(as_json["attention"]["weights"], alone["attention"]["weights"],
                               atol=1e-6)
    assert not {"logit_lens", "head_attribution", "residual_norms"} & set(alone)


@pytest.mark.parametrize("extra, field", [
    ({"include": ["logit_lens"], "top_k": 21}, "top_k"),
    ({"include": ["logit_lens"], "top_k": 0}, "top_k"),
    ({"include": ["head_attribution"], "target": 10**6}, "target"),
    ({"include": ["head_attribution"], "position": 500}, "position"),
    ({"include": ["logit_lens"], "format": "png"}, "include"),
    ({"include": ["lens"]}, "include")])
def test_bad_look_inside_requests_are_422_naming_the_field(
        client: httpx.Client, extra: dict[str, Any], field: str) -> None:
    r = client.post("/attention", json={"inputs": TEXT} | extra)
    assert r.status_code == 422, r.text
    assert field in r.text


def test_an_artifact_exported_before_the_members_refuses_them_and_serves_the_maps(
        artifact: Path, start_server: Callable[..., Any], tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    config = io.ArtifactConfig.load(old)
    graph = old / io.ATTENTION_FILE
    graph.write_bytes(cut(graph.read_bytes(), io.attention_output_names(config.n_layers)))
    manifest = load_manifest(old)
    manifest.files[io.ATTENTION_FILE] = FileEntry(sha256_file(graph), graph.stat().st_size)
    dataclasses.replace(manifest).write(old)
    with httpx.Client(base_url=start_server(model=old).url, timeout=60) as c:
        r = c.post("/attention", json={"inputs": TEXT, "include": ["weights", "logit_lens"]})
        assert r.status_code == 409, r.text
        assert "re-export" in r.text and "include" in r.text
        maps = c.post("/attention", json={"inputs": TEXT})
        assert maps.status_code == 200 and len(maps.json()["attention"]["weights"]) == \
            config.n_layers
