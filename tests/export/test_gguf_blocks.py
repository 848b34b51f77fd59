"""`attnserve export --quantize gguf`: a GGUF file's own blocks as MatMulNBits.

Small random Llama models are built with transformers, written as GGUF files with the
`gguf` package (tests/gguf_files.py; `gguf.quants.quantize` makes the blocks, random bytes
with sane scales the K-quants' blocks, which gguf only dequantises), imported,
and exported with the GGUF file's blocks kept. The references are independent of the code
under test: gguf's own dequantiser on the file's tensors (rows put back in transformers'
order by inverting llama.cpp's permutation written here), ONNX Runtime running each
rewritten weight product alone on an identity input (so its output is the weight it
dequantises), and the PyTorch model of the imported, dequantised checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from export.gguf import blocks as gguf_blocks
from export.to_onnx import export_artifact
from export.verify.engine_parity import EngineDecoder
from model.checkpoint import load_checkpoint, read_meta
from model.gguf.to_checkpoint import import_gguf_checkpoint
from service.cli import main as cli_main
from service.contract.engine_spec import ENGINE_FILE
from service.contract.graphs import FLOAT32_PASS_TOKENS
from service.contract.reference import OrtDecoder
from tests.conftest import torch_threads
from tests.gguf_files import Q, TokenizerSpec, llamacpp_permute, write_gguf
from tests.hf_llama import CHATML, ENDOFTEXT, IM_END, IM_START, build_hf_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

SMALL = {"hidden_size": 128, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": True}  # heads of 32
KSMALL = {**SMALL, "hidden_size": 256, "intermediate_size": 512}  # K-quants: 256 a block


@dataclass(frozen=True)
class Case:
    family: str  # llama | qwen2 | gpt2
    types: tuple[Any, ...]  # the file's matrices take these in turn
    overrides: dict[str, Any]


CASES = {"q4_0": Case("llama", (Q.Q4_0,), SMALL), "q8_0": Case("llama", (Q.Q8_0,), SMALL),
         "q4_1": Case("llama", (Q.Q4_1,), SMALL),
         # Q|K|V: Q4_1 | Q5_1 | Q4_0 (8-bit rows between 4-bit ones); gate | up: Q8_0 | Q5_0,
         # Q5_0 | Q5_1 (8-bit, joined); F16 tensors (their weights fall back to our int8)
         "mixed": Case("llama", (Q.Q4_1, Q.Q4_0, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.F16), SMALL),
         # Qwen2: Q/K/V biases, rows not permuted, an output.weight of its own
         "qwen2-untied": Case("qwen2", (Q.Q4_1, Q.Q4_0),
                              {**SMALL, "tie_word_embeddings": False}),
         # GPT-2: one attn_qkv tensor, biases, learned positions
         "gpt2": Case("gpt2", (Q.Q4_0, Q.Q8_0), {"n_embd": 64}),
         # K-quants as Q4_K_M mixes them: gate | up and Q | K | V of Q4_K beside Q6_K rows
         "kquants": Case("llama", (Q.Q4_K, Q.Q6_K), KSMALL),
         # every block format: gate | up Q5_K | Q8_0 (8-bit, block 32, joined), Q | K | V
         # Q5_K | Q2_K | Q8_0 (Q and V in one product, K at block 16), Q3_K | Q8_0 | Q5_K
         "kquants-low": Case("llama", (Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q8_0), KSMALL)}
FALLBACK_CASES = ("mixed",)
FORMAT = {Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q5_0: (8, 32), Q.Q5_1: (8, 32),
          Q.Q8_0: (8, 32), Q.Q2_K: (4, 16), Q.Q3_K: (4, 16), Q.Q4_K: (4, 32),
          Q.Q5_K: (8, 32), Q.Q6_K: (8, 16)}  # the kept types' (bits, block size)
KEPT = set(FORMAT)
# llama.cpp names of each graph weight (model.onnx | engine.onnx).
QKV = {"llama": ("attn_q", "attn_k", "attn_v"), "qwen2": ("attn_q", "attn_k", "attn_v"),
       "gpt2": ("attn_qkv",)}
LAYER_WEIGHTS = {"o.w": ("attn_output",), "w_o": ("attn_output",), "gate.w": ("ffn_gate",),
                 "up.w": ("ffn_up",), "down.w": ("ffn_down",)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@dataclass(frozen=True)
class Built:
    gguf: Path
    ckpt: Path
    artifact: Path


def write_file(root: Path, case: Case, seed: int = 1) -> Path:
    """A transformers model of ``case`` written as a GGUF file of its types."""
    hf = root / "hf"
    if case.family == "gpt2":
        from tests.hf_gpt2 import build_hf_model as build_gpt2

        build_gpt2(hf, "tokenizer.json", seed=seed, n_positions=128, **case.overrides)
        spec = TokenizerSpec(pre="gpt-2", bos=ENDOFTEXT, eos=ENDOFTEXT)
    else:
        build_hf_model(hf, case.family, seed=seed, **case.overrides)  # type: ignore[arg-type]
        spec = TokenizerSpec(pre="gpt-2", bos=IM_START, eos=IM_END, pad=IM_END,
                             chat_template=CHATML)
    (root / "gguf").mkdir(exist_ok=True)
    return write_gguf(hf, root / "gguf" / "model.gguf", case.types, spec)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            path = write_file(root, CASES[name])
            ckpt = import_gguf_checkpoint(path, root / "ckpt")
            # Verified, "kquants" too: its random K-quant weights' honest attention rounding
            # (1.5e-5) is within verify.py's scale-aware bound.
            art = export_artifact(ckpt, root / "art", quantize="gguf", engine_graph=True)
            cache[name] = Built(path, ckpt, art)
        return cache[name]

    return get


def gguf_reference(path: Path, family: str, weight: str,
                   layer: int | None) -> tuple[np.ndarray, list[Any]]:
    """The (N, K) float32 weight gguf dequantises for a graph weight, and the types."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    heads, kv = SMALL["num_attention_heads"], SMALL["num_key_value_heads"]
    if layer is None:
        names = ["output" if "output.weight" in tensors else "token_embd"]
    else:
        parts = QKV[family] if weight in ("qkv.w", "w_qkv") else LAYER_WEIGHTS[weight]
        names = [f"blk.{layer}.{n}" for n in parts]
    rows, types = [], []
    for name in names:
        t = tensors[f"{name}.weight"]
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # (N, K)
        if family == "llama" and name.endswith(("attn_q", "attn_k")):  # invert llama.cpp's
            n = heads if name.endswith("attn_q") else kv
            order = llamacpp_permute(np.arange(w.shape[0]), n, None)
            w = w[np.argsort(order)]
        rows.append(w)
        types.append(t.tensor_type)
    return np.concatenate(rows), types


def run_between(model: onnx.ModelProto, source: str, out: str, base: Path,
                feed: np.ndarray, float_activations: bool = False) -> np.ndarray:
    """The nodes of ``model`` between the value ``source`` and ``out``, alone in a graph
    (their initializers loaded from ``base``), run on ``feed`` in ``source``'s place;
    ``float_activations``: every MatMulNBits at accuracy level 0."""
    produced = {o: n for n in model.graph.node for o in n.output}
    nodes: list[onnx.NodeProto] = []

    def needs(value: str) -> None:  # the nodes between source and ``value``, in order
        n = produced.get(value)
        if value == source or n is None or n in nodes:
            return
        for i in n.input:
            needs(i)
        nodes.append(n)

    needs(out)
    copies = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[:] = ["feed" if i == source else i for i in c.input]
        for a in c.attribute:
            if float_activations and a.name == "accuracy_level":
                a.i = 0
        copies.append(c)
    wanted = {i for c in copies for i in c.input}
    graph = helper.make_graph(
        copies, "between", [helper.make_tensor_value_info(
            "feed", helper.np_dtype_to_tensor_dtype(feed.dtype), list(feed.shape))],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [t for t in model.graph.initializer if t.name in wanted])
    one = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                  helper.make_opsetid("com.microsoft", 1)])
    one.ir_version = 8
    onnx.external_data_helper.load_external_data_for_model(one, str(base))
    import onnxruntime as ort

    session = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"feed": feed})[0]


def effective_weight(model: onnx.ModelProto, node: onnx.NodeProto, base: Path) -> np.ndarray:
    """The (N, K) weight a rewritten product computes: the MatMulNBits node (and, for
    minimums, the nodes adding them) alone in a graph at accuracy level 0 (float
    activations) on an identity input."""
    consumers = {i: n for n in model.graph.node for i in n.input}
    out = node.output[0]
    if out.endswith(".gguf_scaled"):  # exact Q4_1: + block sums · remainders (Add or Gemm)
        out = consumers[out].output[0]
    k = next(a.i for a in node.attribute if a.name == "K")
    return run_between(model, node.input[0], out, base, np.eye(k, dtype=np.float32),
                       float_activations=True).T  # (N, K)


Rows = tuple[str, int | None, slice]  # (graph weight kind, layer, its rows)


def weights_of(node: onnx.NodeProto) -> list[Rows]:
    """The graph weights whose rows a MatMulNBits holds, from its B name: l3.qkv.w.gguf_q
    (kept blocks), l3.gate.w+l3.up.w.gguf_q (kept, joined), l3.qkv.w.rows0-256+
    l3.qkv.w.rows384-512.gguf_q (rows of one format, in a weight of several),
    l3.qkv.w_Q8 / _Q4 (ORT's quantiser)."""
    found: list[Rows] = []
    names = node.input[1].removesuffix(".gguf_q").removesuffix("_Q8").removesuffix("_Q4")
    for name in names.split("+"):
        rows = slice(None)
        if (match := re.fullmatch(r"(.+)\.rows(\d+)-(\d+)", name)) is not None:
            name, rows = match[1], slice(int(match[2]), int(match[3]))
        if name == "lm_head.w":
            found.append((name, None, rows))
            continue
        layer, _, kind = name.partition(".")
        found.append((kind, int(layer[1:]), rows))
    return found


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("graph", ["model.onnx", ENGINE_FILE])
def test_weights_are_the_files_dequantised_blocks(case: str, graph: str,
                                                  built: Callable[[str], Built]) -> None:
    """Every kept MatMulNBits, alone on an identity input, is gguf's dequantised rows; every
    weight's rows are held once; gate and up are one product where their blocks have one
    format; nothing stays a float product."""
    b = built(case)
    family = CASES[case].family
    model = onnx.load(str(b.artifact / graph), load_external_data=False)
    covered: dict[tuple[str, int | None], list[tuple[int, int]]] = {}
    fallback, joined_ffn = 0, 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        weights = weights_of(node)
        refs = [gguf_reference(b.gguf, family, kind, layer) for kind, layer, _ in weights]
        types = [t for _, ts in refs for t in ts]
        if not node.input[1].endswith(".gguf_q"):  # our quantiser's fallback
            assert not set(types) <= KEPT
            fallback += 1
            covered[weights[0][:2]] = [(0, refs[0][0].shape[0])]
            continue
        assert set(types) <= KEPT
        rows = [r[rs] for (r, _), (_, _, rs) in zip(refs, weights, strict=True)]
        ref = np.concatenate(rows)
        ours = effective_weight(model, node, b.artifact)
        assert ours.shape == ref.shape
        assert np.array_equal(ours, ref), f"{node.name}: {np.abs(ours - ref).max()}"
        for (kind, layer, rs), (r, _) in zip(weights, refs, strict=True):
            covered.setdefault((kind, layer), []).append(rs.indices(r.shape[0])[:2])
        joined_ffn += {k for k, _, _ in weights} >= {"gate.w", "up.w"}
    cfg = read_meta(b.ckpt).model
    per_layer = 5 if cfg.arch == "llama" else 4  # GPT-2: no gate
    assert len(covered) == per_layer * cfg.n_layers + 1  # every projection, the head
    for (kind, layer), spans in covered.items():  # each row once: the spans tile 0..N
        n = gguf_reference(b.gguf, family, kind, layer)[0].shape[0]
        starts, stops = zip(*sorted(spans), strict=True)
        assert starts == (0, *stops[:-1]) and stops[-1] == n, (kind, layer, spans)
    assert (fallback > 0) == (case in FALLBACK_CASES)
    if cfg.arch == "llama" and case not in FALLBACK_CASES:  # gate | up: one product a layer
        formats = [{FORMAT[t] for k in ("gate.w", "up.w")
                    for t in gguf_reference(b.gguf, family, k, i)[1]} for i in range(cfg.n_layers)]
        assert joined_ffn == sum(len(f) == 1 for f in formats)
    weights = {t.name for t in model.graph.initializer} - {
        t.name for t in model.graph.initializer if t.name.startswith("gguf.")
        or t.name.endswith(".gguf_mins")}
    assert not [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")
                and n.input[1] in weights]  # no float weight product left


def embedding_rows(model: onnx.ModelProto, base: Path, vocab: int) -> tuple[np.ndarray, bool]:
    """What the graph's embedding computes for every token id (the nodes from the ids to
    tok_gather's output, alone in a graph), and whether they read blocks (the rewritten
    form) rather than a float32 table."""
    by_name = {n.name: n for n in model.graph.node}
    blocks = "tok_gather.gguf_ids" in by_name
    ids = (by_name["tok_gather.gguf_ids"] if blocks else by_name["tok_gather"]).input[
        0 if blocks else 1]
    rows = run_between(model, ids, by_name["tok_gather"].output[0], base,
                       np.arange(vocab, dtype=np.int64))
    return rows, blocks


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("graph", ["model.onnx", "attention.onnx", ENGINE_FILE])
def test_the_embedding_is_the_files_dequantised_rows(case: str, graph: str,
                                                    built: Callable[[str], Built]) -> None:
    """Every token's embedding is gguf's dequantised token_embd row, bit for bit, read from
    the kept blocks where its type is kept (from the LM head's own blocks when tied:
    stored once); a float tensor (F16) stays a float32 table, which is exact too."""
    b = built(case)
    reader = gguf.GGUFReader(b.gguf)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ref = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # (V, d)
    model = onnx.load(str(b.artifact / graph), load_external_data=False)
    rows, from_blocks = embedding_rows(model, b.artifact, ref.shape[0])
    assert from_blocks == (tensor.tensor_type in KEPT)
    assert rows.dtype == np.float32 and np.array_equal(rows, ref)
    tied = "output.weight" not in {t.name for t in reader.tensors}
    if from_blocks and tied and graph != "attention.onnx":  # attention.onnx has no head
        codes = next(n for n in model.graph.node if n.name == "tok_gather.gguf_gather").input[0]
        head = [n for n in model.graph.node if n.op_type == "MatMulNBits"
                and weights_of(n)[0][0] == "lm_head.w"]
        assert [n.input[1] for n in head] == [codes]


@pytest.mark.parametrize("case", list(CASES))
def test_the_artifact_holds_the_blocks_and_no_float_copy(case: str,
                                                         built: Callable[[str], Built]) -> None:
    """By default a --quantize gguf artifact stores the file's blocks and no float32 copy
    of a weight matrix (no float32 weights for long passes; attention.onnx reads the
    blocks), and its table of graphs says so: every
    large float32 tensor is a per-block table (scales, minimums) or a block-sum matrix.
    Q4_0 and Q8_0 blocks keep their size but for float32 scales (20/18 and 36/34 bytes a
    block), so those artifacts stay near the file's tensor bytes (alignment and norms
    weigh more at this size than at real ones)."""
    b = built(case)
    assert not [p.name for p in b.artifact.iterdir()
                if p.name.startswith("engine_float32")
                or p.name.endswith(".data")]  # the quantised graphs' side files: all moved
    manifest = json.loads((b.artifact / "manifest.json").read_text("utf-8"))
    assert {g["weights"] for g in manifest["graphs"]} == {"stored"}
    tables = (".gguf_scales", ".gguf_mins", ".gguf_row_mins")
    for graph in sorted(b.artifact.glob("*.onnx")):
        model = onnx.load(str(graph), load_external_data=False)
        large = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT
                 and int(np.prod(t.dims)) > 4096 and not t.name.endswith(tables)
                 and not t.name.startswith("gguf.block_sums")]
        floats = {"pos_emb"}  # GPT-2's learned positions: an F32 tensor in the file too
        if case in FALLBACK_CASES:  # an F16 embedding is a float32 table (see above)
            floats.add("tok_emb")
        large = [n for n in large if n not in floats]
        assert large == [], (graph.name, large)
    reader = gguf.GGUFReader(b.gguf)
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    stored = (b.artifact / "weights.bin").stat().st_size
    assert manifest["exporter"]["storage"]["source_bytes"] == b.gguf.stat().st_size
    if case in ("q4_0", "q8_0"):
        assert stored < 1.25 * tensor_bytes, stored / tensor_bytes


@pytest.mark.parametrize("minimums", [False, True])
def test_byte_codes_at_float_activations_are_two_exact_nibble_products(minimums: bool) -> None:
    """At float activations an 8-bit block is two 4-bit products (ORT has no fast 8-bit
    kernel there): their sum, on an identity input, is the blocks' dequantised weight
    exactly without minimums, and within one rounding of it with them."""
    from export.gguf.blocks import BlockWriter
    from model.gguf.codes import Blocks

    rng = np.random.default_rng(0)
    n, nb, block = 24, 4, 16
    scales = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float16).astype(np.float32)
    mins = (-scales * rng.integers(0, 200, (n, nb))).astype(np.float32) if minimums else None
    blocks = Blocks(8, rng.integers(0, 256, (n, nb, block)).astype(np.uint8), scales, mins)
    writer = BlockWriter("exact", 0)
    writer.matmul("x", "y", blocks, "w", "w")
    assert {nd.op_type for nd in writer.nodes} >= {"MatMulNBits", "Add"}
    assert all({a.name: a.i for a in nd.attribute}["bits"] == 4 for nd in writer.nodes
               if nd.op_type == "MatMulNBits")
    model = onnx.ModelProto()
    model.graph.node.extend(writer.nodes)
    model.graph.initializer.extend(writer.inits.values())
    ours = run_between(model, "x", "y", Path("."), np.eye(nb * block, dtype=np.float32)).T
    ref = blocks.dequantize()
    if minimums:
        np.testing.assert_allclose(ours, ref, rtol=0, atol=2 * np.abs(ref).max() * 2.0 ** -24)
    else:
        assert np.array_equal(ours, ref)


@pytest.mark.parametrize("case", ["q8_0", "kquants", "gpt2"])
def test_float_activations_serve_the_float32_models_logits(case: str,
                                                           built: Callable[[str], Built],
                                                           tmp_path: Path) -> None:
    """--activations float: every product at accuracy level 0 and 4-bit (8-bit blocks
    split), logits within 1e-4 relative of PyTorch on the imported checkpoint, the
    embedding still gguf's rows bit for bit."""
    b = built(case)
    art = export_artifact(b.ckpt, tmp_path / "float", quantize="gguf", engine_graph=True,
                          verify=False, activations="float")
    for graph in ("model.onnx", ENGINE_FILE):
        model = onnx.load(str(art / graph), load_external_data=False)
        levels = {(a.name, a.i) for nd in model.graph.node if nd.op_type == "MatMulNBits"
                  for a in nd.attribute if a.name in ("accuracy_level", "bits")}
        assert levels == {("accuracy_level", 0), ("bits", 4)}, (graph, levels)
    gpt = load_checkpoint(b.ckpt).model.eval()
    ids = np.random.default_rng(0).integers(3, gpt.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = gpt(torch.from_numpy(ids)).logits.float().numpy()  # (B, T, V)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    dec = OrtDecoder.from_artifact(art)
    got, _ = dec(ids, np.ones_like(ids), pos, dec.empty_past(2))
    assert float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean())) < 1e-4
    reader = gguf.GGUFReader(b.gguf)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows, from_blocks = embedding_rows(onnx.load(str(art / "model.onnx"),
                                                 load_external_data=False), art,
                                       int(tensor.shape[-1]))
    assert from_blocks and np.array_equal(
        rows, gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type))


def test_opt_in_copies_are_written_and_sized(built: Callable[[str], Built],
                                             tmp_path: Path) -> None:
    """--float32-twin adds engine_float32.onnx, in the table for long passes, and the
    manifest records the bytes it added to weights.bin (what the default artifact saves)."""
    b = built("q4_1")
    art = export_artifact(b.ckpt, tmp_path / "art", quantize="gguf", engine_graph=True,
                          verify=False, float32_twin=True)
    manifest = json.loads((art / "manifest.json").read_text("utf-8"))
    added = manifest["exporter"]["storage"]["opt_in_bytes"]
    assert set(added) == {"engine_float32.onnx"}
    (long,) = [g for g in manifest["graphs"] if g["runs"] == "long passes"]
    assert long["file"] == "engine_float32.onnx" and long["weights"] == "float32"
    assert long["from_tokens"] == FLOAT32_PASS_TOKENS["gguf"]
    growth = (art / "weights.bin").stat().st_size - (b.artifact / "weights.bin").stat().st_size
    # each new tensor may start at an aligned offset: at most one alignment's padding each
    assert sum(added.values()) <= growth <= sum(added.values()) + 4096 * 64
    cfg = read_meta(b.ckpt).model
    float_weights = 4 * sum(p.numel() for p in load_checkpoint(b.ckpt).model.parameters())
    assert added["engine_float32.onnx"] >= 0.9 * float_weights - 4 * cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("case", ["q4_0", "q8_0", "q4_1", "qwen2-untied", "gpt2", "kquants",
                                  "kquants-low"])
def test_logits_match_the_dequantised_checkpoint(case: str,
                                                 built: Callable[[str], Built]) -> None:
    """model.onnx and engine.onnx against PyTorch on the imported checkpoint: within 1e-4
    relative (RMS) with float activations (accuracy level 0: the weights are exact),
    within 3% with the artifact's int8 activations (level 4, what is served)."""
    b = built(case)
    gpt = load_checkpoint(b.ckpt).model.eval()
    ids = np.random.default_rng(0).integers(3, gpt.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = gpt(torch.from_numpy(ids)).logits.float().numpy()  # (B, T, V)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    for level in (0, 4):
        art = b.artifact if level == 4 else float_activations(b.artifact)
        dec = OrtDecoder.from_artifact(art)
        model_logits, _ = dec(ids, np.ones_like(ids), pos, dec.empty_past(2))
        eng = EngineDecoder(art / ENGINE_FILE, gpt)
        engine_logits, _ = eng(ids, np.ones_like(ids), pos, eng.empty_past(2))
        bound = 1e-4 if level == 0 else 0.03
        for name, got in (("model.onnx", model_logits), ("engine.onnx", engine_logits)):
            rel = float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()))
            print(f"{case} level {level} {name}: relative RMS error {rel:.2e}")
            assert rel < bound, (name, level, rel)
            assert (got.argmax(-1) == ref.argmax(-1)).mean() > (0.999 if level == 0 else 0.9)



@pytest.mark.parametrize("case", ["q4_1", "kquants"])
def test_block_sums_by_reduction_keep_the_logits(case: str, built: Callable[[str], Built],
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Block sums past ``SUMS_MATRIX_BYTES`` (a 1B model's FFN input) are a ReduceSum over
    a view of the input instead of a MatMul by a 0/1 matrix. Forced for every input here
    (the test models are too small to reach it): no such matrix is left, and model.onnx
    and engine.onnx match PyTorch on the checkpoint within 1e-4 RMS at float activations,
    as the MatMul form does."""
    b = built(case)
    monkeypatch.setattr(gguf_blocks, "SUMS_MATRIX_BYTES", 0)
    art = export_artifact(b.ckpt, tmp_path / "art", quantize="gguf", engine_graph=True)
    for name in ("model.onnx", ENGINE_FILE):
        graph = onnx.load(str(art / name), load_external_data=False).graph
        assert not [t.name for t in graph.initializer if t.name.startswith("gguf.block_sums")]
        assert any(n.op_type == "ReduceSum" for n in graph.node)
    gpt = load_checkpoint(b.ckpt).model.eval()
    ids = np.random.default_rng(0).integers(3, gpt.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = gpt(torch.from_numpy(ids)).logits.float().numpy()  # (B, T, V)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    level0 = float_activations(art)
    dec = OrtDecoder.from_artifact(level0)
    eng = EngineDecoder(level0 / ENGINE_FILE, gpt)
    for name, (got, _) in (("model.onnx", dec(ids, np.ones_like(ids), pos, dec.empty_past(2))),
                           (ENGINE_FILE, eng(ids, np.ones_like(ids), pos, eng.empty_past(2)))):
        rel = float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()))
        assert rel < 1e-4, (name, rel)

def float_activations(artifact: Path) -> Path:
    """A copy of the artifact whose MatMulNBits nodes run at accuracy level 0."""
    out = artifact.with_name(artifact.name + "-level0")
    if not out.exists():
        shutil.copytree(artifact, out)
        for name in ("model.onnx", ENGINE_FILE):
            model = onnx.load(str(out / name), load_external_data=False)
            for node in model.graph.node:
                for a in node.attribute:
                    if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                        a.i = 0
            onnx.save_model(model, str(out / name))
    return out


@pytest.mark.parametrize("case", ["mixed", "kquants", "kquants-low"])
def test_manifest_records_kept_and_fallback(case: str, built: Callable[[str], Built]) -> None:
    """The kept tensors are counted by type (every K-quant among them); each fallback weight
    (one with an F16 tensor) is listed with its types and the quantiser it got."""
    manifest = json.loads((built(case).artifact / "manifest.json").read_text("utf-8"))
    assert manifest["quantization"] == "gguf"
    types = {t.name for t in CASES[case].types}
    for key in ("quantized", "engine_quantized"):
        figures = manifest["verification"][key]
        assert set(figures["kept_tensors"]) == types - {"F16"}
        assert bool(figures["fallback"]) == (case in FALLBACK_CASES)
        for f in figures["fallback"].values():
            assert "F16" in f["types"] and f["as"] == "int8", f
        assert figures["split_products"] > 0  # Q4_1 | Q5_1 | Q4_0, Q4_K | Q6_K...
        assert (16 in figures["block_sizes"]) == (case != "mixed")
    # every case is judged, at least on the served graph
    assert "perplexity_relative_change" in manifest["verification"]["engine_quantized"]


def test_fallback_bits_follow_the_bits_a_weight() -> None:
    """A weight not kept goes to our int4 where all its types have at most 4.5 bits a weight
    (none the import reads now: IQ4_NL here), else int8."""
    from types import SimpleNamespace

    from export.gguf.blocks import fallback_bits
    from export.gguf.source import Part

    tensors = {name: SimpleNamespace(tensor_type=kind) for name, kind in
               (("a", Q.IQ4_NL), ("b", Q.BF16), ("c", Q.F16), ("d", Q.IQ2_XS))}

    def bits(*names: str) -> int:
        src = SimpleNamespace(tensors=tensors)
        return fallback_bits(src, [Part(n, np.arange(1)) for n in names])  # type: ignore[arg-type]

    assert (bits("a"), bits("a", "d"), bits("b"), bits("c"), bits("a", "b")) == (4, 4, 8, 8, 8)


def test_real_smollm2_blocks_are_exact() -> None:
    """The real SmolLM2 file (Q4_1 projections, Q8_0 embedding): each form's weights,
    dequantised by ONNX Runtime, equal gguf's, on real scales and minimums."""
    from export.gguf.blocks import BlockWriter, read_blocks
    from model.default_model import default_gguf_path, install_hint

    path = default_gguf_path()
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed at {path}: {install_hint()}")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_up.weight",
                 "token_embd.weight"):
        t = tensors[name]
        blocks = read_blocks(t)
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        for halves in (False, True):  # Q8_0 as one 8-bit product or two 4-bit ones
            writer = BlockWriter("exact", 0, halves=halves)
            writer.matmul("x", "y", blocks, "w", "w")
            model = onnx.ModelProto()
            model.graph.node.extend(writer.nodes)
            model.graph.initializer.extend(writer.inits.values())
            ours = run_between(model, "x", "y", Path("."),
                               np.eye(ref.shape[1], dtype=np.float32)).T  # (N, K)
            assert np.array_equal(ours, ref), (name, float(np.abs(ours - ref).max()))


def test_refusals_exit_2_and_write_nothing(built: Callable[[str], Built], tmp_path: Path,
                                          tiny_checkpoint: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    b = built("q4_0")

    def refused(ckpt: Path, needle: str) -> None:
        out = tmp_path / "out"
        assert cli_main(["export", "--ckpt", str(ckpt), "--out", str(out),
                         "--quantize", "gguf"]) == 2
        err = capsys.readouterr().err.strip().splitlines()  # progress lines, then the error
        assert err and needle in err[-1] and err[-1].startswith("attnserve export: error:"), err
        assert not out.exists() and not any(p.name.startswith(".out") for p in
                                            tmp_path.iterdir())

    refused(tiny_checkpoint, "not")  # trained here, never imported from GGUF
    # A --float32 checkpoint reads the blocks from the imported file, wherever it was.
    source = tmp_path / "source.gguf"
    shutil.copyfile(b.gguf, source)
    float_ckpt = import_gguf_checkpoint(source, tmp_path / "f32-ckpt", float32=True)
    source.rename(source.with_suffix(".moved"))
    refused(float_ckpt, "gone")
    source.with_suffix(".moved").rename(source)
    original = b.gguf.read_bytes()
    # Another file of the same size and header written over the imported one (and so over
    # the held one, the same inode): the recorded sha256 tells them apart; for a float32
    # checkpoint imported before the import recorded size and sha256, the blocks do.
    write_file(tmp_path / "other", CASES["q4_0"], seed=7)
    other = (tmp_path / "other" / "gguf" / "model.gguf").read_bytes()
    assert len(other) == len(original) and b.gguf.samefile(b.ckpt / "model.gguf")
    old = tmp_path / "old-ckpt"
    shutil.copytree(float_ckpt, old)
    config = json.loads((old / "config.json").read_text())
    del config["training"]["imported_from"]["size"], config["training"]["imported_from"]["sha256"]
    (old / "config.json").write_text(json.dumps(config))
    try:
        b.gguf.write_bytes(other)
        source.write_bytes(other)
        refused(b.ckpt, "changed since the import: its sha256 is ")
        refused(old, "do not dequantise to the checkpoint's weight")
        b.gguf.write_bytes(original + b"\0")  # one byte appended: refused before hashing
        refused(b.ckpt, "changed since the import: its size is ")
    finally:
        b.gguf.write_bytes(original)
    shutil.rmtree(old)
    shutil.rmtree(tmp_path / "other")


def test_import_records_size_and_sha256(built: Callable[[str], Built]) -> None:
    b = built("q4_0")
    record = read_meta(b.ckpt).training["imported_from"]
    data = b.gguf.read_bytes()
    assert record["size"] == len(data)
    assert record["sha256"] == hashlib.sha256(data).hexdigest()


def test_int4_of_a_gguf_checkpoint_points_to_the_kept_blocks(
        built: Callable[[str], Built], tmp_path: Path) -> None:
    """--quantize int4 of a checkpoint imported from Q4_1 blocks (or K-quants) says that
    --quantize gguf keeps them; nothing is said for types gguf would re-quantise too (F16,
    BF16), for a checkpoint not imported from GGUF, or for gguf itself."""
    from export.quantize.weights import gguf_advice

    b = built("q4_1")
    said: list[str] = []
    export_artifact(b.ckpt, tmp_path / "int4", quantize="int4", verify=False,
                    log=said.append)
    notes = [m for m in said if m.startswith("note:")]
    assert len(notes) == 1 and "Q4_1" in notes[0] and "--quantize gguf" in notes[0]
    training = read_meta(b.ckpt).training
    assert gguf_advice(training, "gguf") is None and gguf_advice(training, None) is None
    kquants = {"imported_from": {**training["imported_from"],
                                 "tensor_types": {"Q4_K": 7, "Q6_K": 1, "F32": 3}}}
    note = gguf_advice(kquants, "int4")
    assert note is not None and "Q4_K/Q6_K blocks" in note
    others = {"imported_from": {**training["imported_from"],
                                "tensor_types": {"F16": 7, "BF16": 1, "F32": 3}}}
    assert gguf_advice(others, "int8") is None
    assert gguf_advice({"imported_from": {"format": "hf"}}, "int8") is None
    assert gguf_advice({}, "int8") is None
