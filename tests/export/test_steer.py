"""`attnserve steer` (export/steer.py): control vectors from contrastive prompt pairs.

The references are independent of the code under test: the hidden states computed block
by block (GPT.embed / GPT.layer, one prompt at a time), the mean and numpy's eigh of XᵀX
for the first principal component, the file read with gguf's own reader; and, where llama.cpp's
tools are built (`python -m benchmarks llamacpp-tools --build`; skipped otherwise), the
vector llama-cvector-generator makes on the same model and prompts, and llama-server's
greedy tokens with our vector loaded (--control-vector-scaled) against our steered
PyTorch model (model/steering.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from export.steer import steer
from model.checkpoint import load_checkpoint
from service.contract.control_vector import read_control_vector
from tests.conftest import torch_threads

N_LAYERS = 4
PAIRS = [  # shared prefixes and lengths that differ, so padding and the row filter matter
    {"positive": "The cat is happy and warm", "negative": "The cat is sad"},
    {"positive": "What a wonderful day", "negative": "What a terrible, awful day it was"},
    {"positive": "I love this", "negative": "I hate this", "note": "other keys are ignored"},
]


def write_pairs(path: Path, pairs: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return path


def attnserve(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", "steer", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama of ours, 4 layers, with a BPE tokenizer of the test corpus."""
    from model.checkpoint import CheckpointMeta, save_checkpoint
    from model.config import config_from_preset
    from model.gpt import GPT
    from model.tokenizer import build_tokenizer, special_ids
    from tests.conftest import tiny_corpus

    tok = build_tokenizer("bpe", [tiny_corpus()], vocab_size=300)
    config = replace(config_from_preset("llama-tiny", vocab_size=tok.get_vocab_size()),
                     n_layers=N_LAYERS)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    meta = CheckpointMeta(config, {"kind": "bpe", **special_ids(tok).to_dict()})
    return save_checkpoint(tmp_path_factory.mktemp("steer") / "ckpt", model, meta, tok.to_str())


def expected_rows(ckpt: Path, pairs: list[dict[str, str]]) -> tuple[list[np.ndarray], int]:
    """Per block but the last: positive − negative at every position, each prompt run
    alone and block by block, padded with the token of " ", rows with no element above
    1e-6 dropped (cvector-generator's rule); and how many positions there were."""
    from tokenizers import Tokenizer

    loaded = load_checkpoint(ckpt)
    model = loaded.model
    tok = Tokenizer.from_file(str(loaded.tokenizer_path))
    pad = tok.encode(" ", add_special_tokens=False).ids[-1]
    rows: list[list[np.ndarray]] = [[] for _ in range(N_LAYERS - 1)]
    positions = 0
    for pair in pairs:
        ids = [tok.encode(pair[side]).ids for side in ("positive", "negative")]
        n = max(map(len, ids))
        positions += n
        states = []
        for row in ids:
            with torch.no_grad():
                x, context = model.embed(torch.tensor([row + [pad] * (n - len(row))]),
                                         None, None, 0)
                per_layer = []
                for i in range(N_LAYERS - 1):
                    x, _, _ = model.layer(i, x, context, None)
                    per_layer.append(x[0].numpy())  # (T, d)
            states.append(per_layer)
        for i in range(N_LAYERS - 1):
            diff = states[0][i] - states[1][i]
            rows[i].append(diff[diff.max(axis=1) > 1e-6])
    return [np.concatenate(r).astype(np.float64) for r in rows], positions


def file_directions(path: Path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "controlvector"
    assert reader.fields["controlvector.layer_count"].contents() == len(reader.tensors)
    return {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}


def test_the_mean_method_is_the_normalised_mean_difference(checkpoint, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "mean.gguf"
    with torch_threads(1):
        result = attnserve("--ckpt", checkpoint, "--pairs", pairs, "--out", out,
                           "--method", "mean", "--threads", "1")
        assert result.returncode == 0, result.stderr
        rows, positions = expected_rows(checkpoint, PAIRS)
    got = file_directions(out)
    assert sorted(got) == [f"direction.{k}" for k in range(1, N_LAYERS)]
    for i, x in enumerate(rows):
        assert len(x) < positions  # the shared prefixes' rows were dropped
        mean = x.mean(axis=0)
        np.testing.assert_allclose(got[f"direction.{i + 1}"], mean / np.linalg.norm(mean),
                                   atol=1e-5)


def test_the_pca_method_is_the_first_principal_component(checkpoint, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    with torch_threads(1):
        out = steer(checkpoint, pairs, tmp_path / "pca.gguf", "pca")
        rows, _ = expected_rows(checkpoint, PAIRS)
    got = file_directions(out)
    for i, x in enumerate(rows):
        # uncentred, as cvector-generator's power iteration on XᵀX: XᵀX's top
        # eigenvector, pointing where the mean difference points
        first = np.linalg.eigh(x.T @ x)[1][:, -1]
        first = first if first @ x.mean(axis=0) >= 0 else -first
        np.testing.assert_allclose(got[f"direction.{i + 1}"], first, atol=1e-4)
        assert abs(got[f"direction.{i + 1}"] @ first) > 1 - 1e-6


def test_bad_lines_are_named_by_number_and_nothing_is_written(checkpoint, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join([
        json.dumps(PAIRS[0]), "{not json", "", json.dumps({"positive": "only one"}),
        json.dumps({"positive": "", "negative": "x"}), json.dumps(["a", "b"])]) + "\n",
        encoding="utf-8")
    out = tmp_path / "v.gguf"
    result = attnserve("--ckpt", checkpoint, "--pairs", pairs, "--out", out)
    assert result.returncode == 2
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert ("bad lines 2 (not JSON), 4 (no 'negative'), 5 ('positive' is not a non-empty "
            "string), 6 (not an object)") in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]


def test_a_pair_that_differs_nowhere_is_refused(checkpoint, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl",
                        [PAIRS[0], {"positive": "same words", "negative": "same words"}])
    with torch_threads(1), pytest.raises(ValueError, match="line 2: the positive and "
                                         "negative prompts differ nowhere at layer 1"):
        steer(checkpoint, pairs, tmp_path / "v.gguf", "mean")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]


# -- llama.cpp's own tools (skipped where they are not built) --------------------------------
LLAMA_LAYERS = 3
# llama.cpp's KV cache is float16 by default and its flash attention rounds to float16:
# hidden states off by ~1e-3; with these its numbers are ours to float32 rounding
FLOAT32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """family → (its import, the GGUF file the project writes of it): a random-weight
    transformers model of 3 layers, built on first use."""
    pytest.importorskip("transformers")
    from export.gguf.model_file import export_gguf
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    overrides = {"gemma3": {"query_pre_attn_scalar": 32, "sliding_window": None,
                            "layer_types": ["full_attention"] * LLAMA_LAYERS}}
    built: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(f"{family}-steer")
            with torch_threads(1):
                build_hf_model(root / "hf", family, seed=1,  # type: ignore[arg-type]
                               num_hidden_layers=LLAMA_LAYERS, **overrides.get(family, {}))
                ckpt = import_hf_checkpoint(root / "hf", root / "ckpt")
                built[family] = (ckpt, export_gguf(ckpt, root / "model.gguf"))
        return built[family]

    return get


@pytest.fixture
def llama_gguf(gguf_models: Any) -> tuple[Path, Path]:
    return gguf_models("llama")  # type: ignore[no-any-return]


def tool(name: str) -> Path:
    from benchmarks.llamacpp_tools import tool_path

    try:
        return tool_path(name)
    except FileNotFoundError as exc:  # not built on this machine
        pytest.skip(str(exc))


def generated(method: str, model_file: Path, tmp_path: Path) -> Path:
    """llama-cvector-generator's vector of PAIRS[:2] on ``model_file``."""
    generator = tool("llama-cvector-generator")
    positive, negative = tmp_path / "positive.txt", tmp_path / "negative.txt"
    positive.write_text("".join(p["positive"] + "\n" for p in PAIRS[:2]), encoding="utf-8")
    negative.write_text("".join(p["negative"] + "\n" for p in PAIRS[:2]), encoding="utf-8")
    out = tmp_path / f"theirs-{method}.gguf"
    run = subprocess.run([str(generator), "-m", str(model_file), "--positive-file",
                          str(positive), "--negative-file", str(negative), "-o", str(out),
                          "--method", method, "-t", "1", *FLOAT32],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_llama_cvector_generator_s_mean_vector_equals_ours(family, gguf_models, tmp_path):
    """The same hidden states at the same layer outputs (Gemma 3: its √d embedding scale and
    sandwich norms), the same tokens, padding and row filter."""
    ckpt, model_file = gguf_models(family)
    theirs = read_control_vector(generated("mean", model_file, tmp_path), d_model=64,
                                 n_layers=LLAMA_LAYERS)
    assert theirs.layers == (1, 2) and theirs.width == 64 and theirs.model_hint == family
    with torch_threads(1):
        ours = read_control_vector(steer(ckpt, write_pairs(tmp_path / "p.jsonl", PAIRS[:2]),
                                         tmp_path / "ours.gguf", "mean"))
    assert ours.model_hint == family
    # Gemma's GELU: ggml's CPU kernel reads it from a float16 table (GGML_GELU_FP16)
    atol = 1e-4 if family == "gemma3" else 1e-5
    for k in theirs.layers:
        np.testing.assert_allclose(theirs.directions[k], ours.directions[k], atol=atol)


def test_llama_cvector_generator_s_pca_vector_reads_in_ours(llama_gguf, tmp_path):
    """Read only: in llama.cpp 0.3.36 its PCA vector is no eigenvector of XᵀX (seen here:
    every eighth element 0, or blocks of 8 elements repeated, differing run to run); ours
    is checked against numpy's eigh of XᵀX above."""
    _, model_file = llama_gguf
    theirs = read_control_vector(generated("pca", model_file, tmp_path), d_model=64,
                                 n_layers=LLAMA_LAYERS)
    assert theirs.layers == (1, 2) and theirs.width == 64 and theirs.model_hint == "llama"


def ours_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    from model.sample import generate

    with torch.no_grad():
        return generate(model.eval(), torch.tensor([ids]), n, greedy=True
                        ).sequences[0, len(ids):].tolist()


PROMPTS = ([5, 17, 42, 99, 7, 3, 250, 31], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])


@pytest.mark.parametrize("layers", [None, (2, 2)])
def test_our_vector_loads_in_llama_server_and_steers_it_as_our_reference(
        layers, llama_gguf, tmp_path):
    """llama-server --control-vector-scaled OURS:SCALE [--control-vector-layer-range]
    gives the greedy tokens of our model under model/steering.py's steered()."""
    from model.steering import steered
    from tests.llamacpp_server import llama_server

    tool("llama-server")
    ckpt, model_file = llama_gguf
    scale = 4.0
    with torch_threads(1):
        path = steer(ckpt, write_pairs(tmp_path / "p.jsonl", PAIRS), tmp_path / "v.gguf", "mean")
        vector = read_control_vector(path, d_model=64, n_layers=LLAMA_LAYERS)
        model = load_checkpoint(ckpt).model
        plain = {tuple(ids): ours_greedy(model, ids, 16) for ids in PROMPTS}
        with steered(model, vector.directions, scale, layers):
            expected = {tuple(ids): ours_greedy(model, ids, 16) for ids in PROMPTS}
    assert expected != plain  # the vector matters at this scale
    args = [*FLOAT32, "--control-vector-scaled", f"{path}:{scale}"]
    if layers is not None:
        args += ["--control-vector-layer-range", *map(str, layers)]
    with llama_server(model_file, log=tmp_path / "server.log", args=args) as server:
        for ids in PROMPTS:
            assert server.greedy(ids, 16) == expected[tuple(ids)], ids
