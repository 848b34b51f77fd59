"""`attnserve export --quantize gguf --kernel ggml`: a GGUF file's bytes, as stored, under
ggml's kernels inside ONNX Runtime (GgufMatMul / GgufGather, service/ops).

The small random models and GGUF files of tests/export/test_gguf_blocks.py (written with the
`gguf` package, imported with `attnserve import --gguf`) are exported with the kept blocks
as the file's rows. The references are independent of the code under test: gguf's own
dequantiser on the file's tensors (rows put back in transformers' order by inverting
llama.cpp's permutation), the PyTorch model of the imported checkpoint, and the MatMulNBits
artifact of the same file (today's --kernel nbits, its own tests in test_gguf_blocks.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

import service.ops
from export.to_onnx import export_artifact
from export.verify.engine_parity import EngineDecoder
from model.checkpoint import load_checkpoint, read_meta
from model.gguf.to_checkpoint import import_gguf_checkpoint
from service.cli import main as cli_main
from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
from service.contract.reference import OrtDecoder
from tests.conftest import torch_threads
from tests.export.test_gguf_blocks import CASES, FALLBACK_CASES, KEPT, gguf_reference, write_file
from tests.service.ops.test_gguf_repacked import file_rows

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

# Q4_1 (the default model's type), Q4_0 (ggml's repack layout: every product but the tied
# head), the K-quant mixes of Q4_K_M files (Q4_K beside Q6_K rows in one weight), a file
# with F16 tensors (their weights fall back to our int8), and GPT-2 (one attn_qkv tensor,
# biases, learned positions).
KERNEL_CASES = ("q4_1", "q4_0", "kquants", "mixed", "gpt2")
OPS = (service.ops.MATMUL_OP, service.ops.GATHER_OP)


@dataclass(frozen=True)
class Exported:
    gguf: Path
    ckpt: Path
    ggml: Path  # --kernel ggml
    nbits: Path  # --kernel nbits, the same file


@pytest.fixture(scope="module")
def exported(gguf_ops_library: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str], Exported]:
    cache: dict[str, Exported] = {}

    def get(name: str) -> Exported:
        if name not in cache:
            root = tmp_path_factory.mktemp(f"kernel-{name}")
            path = write_file(root, CASES[name])
            ckpt = import_gguf_checkpoint(path, root / "ckpt")
            with torch_threads(1):
                ggml = export_artifact(ckpt, root / "ggml", quantize="gguf",
                                       engine_graph=True, kernel="ggml")
                nbits = export_artifact(ckpt, root / "nbits", quantize="gguf",
                                        engine_graph=True, verify=False)
            cache[name] = Exported(path, ckpt, ggml, nbits)
        return cache[name]

    return get


def labels(node: onnx.NodeProto) -> list[tuple[str, int | None, slice]]:
    """(graph weight kind, layer, rows) of each weight a GgufMatMul's W holds, from its
    name: l3.qkv.w.gguf_rows, l3.gate.w+l3.up.w.gguf_rows (joined), l3.qkv.w.rows0-256.gguf_rows
    (the rows of one type in a weight of several), lm_head.w.gguf_rows (tok_emb.gguf_rows:
    the tied head of attention.onnx's lens)."""
    found: list[tuple[str, int | None, slice]] = []
    for name in node.input[1].removesuffix(".gguf_rows").split("+"):
        rows = slice(None)
        if (match := re.fullmatch(r"(.+)\.rows(\d+)-(\d+)", name)) is not None:
            name, rows = match[1], slice(int(match[2]), int(match[3]))
        # the tied head: attention.onnx's lens names the product by the embedding it reads
        if name in ("lm_head.w", "lm_head.weight", "tok_emb"):
            found.append(("lm_head.w", None, rows))
            continue
        layer, _, kind = name.partition(".")
        found.append((kind, int(layer[1:]), rows))
    return found


def attribute(node: onnx.NodeProto, name: str) -> int:
    return next(int(a.i) for a in node.attribute if a.name == name)


def stored(model: onnx.ModelProto, name: str) -> np.ndarray:
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return numpy_helper.to_array(tensor)


def layout(node: onnx.NodeProto) -> str:
    return next(a.s.decode() for a in node.attribute if a.name == "layout")


# What the export writes in ggml's repack layout (where ggml has it: x86 with AVX2), in
# groups of 8 rows (IQ4_NL too: no case here).
REPACKABLE = (gguf.GGMLQuantizationType.Q4_0,)


def repacks_here() -> bool:
    """Whether ggml lays Q4_0 out in its repack layout on this CPU (AVX2)."""
    return service.ops.repack(2, 32, np.zeros((8, 18), np.uint8))[0] is not None


@pytest.mark.parametrize("case", [c for c in KERNEL_CASES if c != "gpt2"])
@pytest.mark.parametrize("graph", ["model.onnx", ENGINE_FILE, ENGINE_MIXED_FILE])
def test_products_hold_the_files_rows_once(case: str, graph: str,
                                           exported: Callable[[str], Exported]) -> None:
    """Every GgufMatMul's W is the file's rows as stored, one GGUF type a node (gguf's
    dequantiser on those bytes gives the file's weights, rows in transformers' order), or
    for Q4_0 those rows in ggml's repack layout (every Q4_0 product of whole groups of 8
    rows but a tied head, whose rows the embedding reads as stored); every projection and
    the head are covered, each row once; gate | up and Q | K | V rows of one type are one
    node; nothing else is a weight product but our quantiser's fallback."""
    e = exported(case)
    family = CASES[case].family
    model = onnx.load(str(e.ggml / graph))  # weights.bin read in: the models are small
    tied = "output.weight" not in {t.name for t in gguf.GGUFReader(e.gguf).tensors}
    covered: dict[tuple[str, int | None], list[tuple[int, int]]] = {}
    layouts: set[tuple[gguf.GGMLQuantizationType, str]] = set()
    for node in model.graph.node:
        if node.op_type != service.ops.MATMUL_OP:
            continue
        assert node.domain == service.ops.DOMAIN
        rows_bytes = stored(model, node.input[1])
        assert rows_bytes.dtype == np.uint8 and rows_bytes.ndim == 2
        kind = gguf.GGMLQuantizationType(attribute(node, "ggml_type"))
        assert kind in KEPT
        weights = labels(node)
        gathered = weights[0][0] == "lm_head.w" and tied
        repacked = (kind in REPACKABLE and rows_bytes.shape[0] % 8 == 0 and not gathered
                    and repacks_here())
        assert layout(node) == (service.ops.REPACKED_LAYOUT if repacked else "rows"), node.name
        layouts.add((kind, layout(node)))
        if repacked:
            rows_bytes = file_rows(rows_bytes, kind)
        refs = [gguf_reference(e.gguf, family, w, layer) for w, layer, _ in weights]
        assert all(kind in types for _, types in refs)
        ref = np.concatenate([r[rows] for (r, _), (_, _, rows) in zip(refs, weights,
                                                                       strict=True)])
        ours = gguf.quants.dequantize(rows_bytes, kind)  # (N, K)
        assert attribute(node, "k") == ref.shape[1]
        assert np.array_equal(ours, ref), node.name
        for (w, layer, rows), (r, _) in zip(weights, refs, strict=True):
            covered.setdefault((w, layer), []).append(rows.indices(r.shape[0])[:2])
    cfg = read_meta(e.ckpt).model
    fallback = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert bool(fallback) == (case in FALLBACK_CASES)
    assert len(covered) + len(fallback) == 5 * cfg.n_layers + 1  # projections and head
    for (w, layer), spans in covered.items():  # each row once: the spans tile 0..N
        n = gguf_reference(e.gguf, family, w, layer)[0].shape[0]
        starts, stops = zip(*sorted(spans), strict=True)
        assert starts == (0, *stops[:-1]) and stops[-1] == n, (w, layer, spans)
    if repacks_here():  # the cases' repackable types are laid out so somewhere
        assert {k for k, where in layouts if where == service.ops.REPACKED_LAYOUT} == {
            k for k, _ in layouts if k in REPACKABLE}
    if case == "q4_1":  # one type everywhere: gate | up and Q | K | V one node each
        assert sum(1 for n in model.graph.node if n.op_type == service.ops.MATMUL_OP
                   ) == 4 * cfg.n_layers + 1
    weights = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT
               and len(t.dims) == 2}
    assert not [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")
                and n.input[1] in weights]  # no float weight product left


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_the_embedding_reads_the_files_rows(case: str,
                                            exported: Callable[[str], Exported]) -> None:
    """The embedding is GgufGather over token_embd's bytes as stored (the LM head's own
    tensor where tied: one initializer) in every graph; a float tensor (F16) stays a float32
    table. Its values: see the logits test below and tests/service/ops."""
    e = exported(case)
    reader = gguf.GGUFReader(e.gguf)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    for graph in ("model.onnx", "attention.onnx", ENGINE_FILE):
        model = onnx.load(str(e.ggml / graph))
        gather = next(n for n in model.graph.node if n.name == "tok_gather")
        if embd.tensor_type not in KEPT:
            assert gather.op_type == "Gather"
            continue
        assert (gather.op_type, gather.domain) == (service.ops.GATHER_OP, service.ops.DOMAIN)
        assert attribute(gather, "ggml_type") == int(embd.tensor_type)
        rows = stored(model, gather.input[1])
        assert np.array_equal(rows, np.asarray(embd.data).view(np.uint8).reshape(rows.shape))
        head = [n for n in model.graph.node if n.op_type == service.ops.MATMUL_OP
                and labels(n)[0][0] == "lm_head.w"]
        if "output.weight" not in tensors and graph != "attention.onnx":  # tied
            assert [n.input[1] for n in head] == [gather.input[1]]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_logits_match_the_checkpoint_and_the_matmulnbits_graphs(
        case: str, exported: Callable[[str], Exported]) -> None:
    """model.onnx and engine.onnx over the file's bytes against PyTorch on the imported
    checkpoint, within the bound the MatMulNBits graphs are held to at int8 activations
    (3% RMS, test_gguf_blocks.py), as the MatMulNBits graphs of the same file are. (ggml
    rounds K-quants' activations to Q8_K, 256 to a scale: on these random blocks 2.7e-2 from
    PyTorch where MatMulNBits' 32 to a scale are 1.7e-2; on Q4_1 both 2e-2.)"""
    e = exported(case)
    gpt = load_checkpoint(e.ckpt).model.eval()
    ids = np.random.default_rng(0).integers(3, gpt.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = gpt(torch.from_numpy(ids)).logits.float().numpy()  # (B, T, V)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()

    def logits(art: Path) -> dict[str, np.ndarray]:
        dec = OrtDecoder.from_artifact(art)
        eng = EngineDecoder(art / ENGINE_FILE, gpt)
        return {"model.onnx": dec(ids, np.ones_like(ids), pos, dec.empty_past(2))[0],
                ENGINE_FILE: eng(ids, np.ones_like(ids), pos, eng.empty_past(2))[0]}

    def rel(got: np.ndarray, want: np.ndarray) -> float:
        return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))

    ours, theirs = logits(e.ggml), logits(e.nbits)
    for name, got in ours.items():
        print(f"{case} {name}: ggml {rel(got, ref):.2e}, MatMulNBits "
              f"{rel(theirs[name], ref):.2e} from PyTorch; apart {rel(got, theirs[name]):.2e}")
        assert rel(got, ref) < 0.03, name
        assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9, name
        # each within the bound of PyTorch's logits, so at most the two bounds apart
        assert rel(got, theirs[name]) < 2 * 0.03, name


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_manifest_and_size(case: str, exported: Callable[[str], Exported]) -> None:
    """The table of graphs says which graphs need the op library (every decoder and adapter
    graph here); attention.onnx, the file's rows dequantised by GgufGather at float
    activations, is verified against PyTorch by the float32 rule where every weight is
    kept; weights.bin holds each kept tensor's bytes exactly once (the rest: norms, rotary
    tables), well under the MatMulNBits artifact of the same file."""
    e = exported(case)
    manifest = json.loads((e.ggml / "manifest.json").read_text("utf-8"))
    assert manifest["graphs"] and {g["kernel"] for g in manifest["graphs"]} == {"ggml"}
    assert {g["file"] for g in manifest["graphs"] if g["adapters"]} == {
        "engine_lora.onnx", "engine_mixed_lora.onnx"}
    verification = manifest["verification"]
    assert verification["passed"] is True
    assert verification["attention_quantized"]["verified"] is (case not in FALLBACK_CASES)
    assert verification["engine_quantized"]["kernel"] == "ggml"
    assert verification["engine_quantized"]["token_agreement"] >= 0.95
    # attention on the library's CachedAttention where the products are on its GgufMatMul;
    # the MatMulNBits artifact keeps ONNX Runtime's GroupQueryAttention
    for name, groups in (("engine.onnx", 1), ("engine_mixed.onnx", 2),
                         ("engine_lora.onnx", 1), ("engine_mixed_lora.onnx", 2)):
        for art, op in ((e.ggml, service.ops.ATTENTION_OP), (e.nbits, "GroupQueryAttention")):
            ops_ = Counter(n.op_type for n in onnx.load(str(art / name),
                                                         load_external_data=False).graph.node)
            layers = json.loads((art / "config.json").read_text("utf-8"))["n_layers"]
            assert (ops_[op], ops_["GroupQueryAttention"] + ops_[service.ops.ATTENTION_OP]) == (
                groups * layers, groups * layers), (art.name, name)
    reader = gguf.GGUFReader(e.gguf)
    # (GPT-2's position table is read as float32 whatever its type: one row a position)
    kept = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type in KEPT
               and t.name != "position_embd.weight")
    rows: dict[int, int] = {}  # offset in weights.bin → bytes, of the uint8 initializers
    for graph in e.ggml.glob("*.onnx"):
        for t in onnx.load(str(graph), load_external_data=False).graph.initializer:
            if t.data_type == TensorProto.UINT8 and t.data_location == TensorProto.EXTERNAL:
                info = {x.key: int(x.value) for x in t.external_data if x.key != "location"}
                rows[info.get("offset", 0)] = info["length"]
    ours = (e.ggml / "weights.bin").stat().st_size
    theirs = (e.nbits / "weights.bin").stat().st_size
    print(f"{case}: weights.bin {ours} bytes (ggml), {theirs} (MatMulNBits); the file's "
          f"kept tensors {kept}, stored as uint8 rows {sum(rows.values())}")
    if case not in FALLBACK_CASES:  # (the fallback's int8 codes are uint8 too)
        assert sum(rows.values()) == kept
    assert ours < theirs


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_swiglu_is_the_products_epilogue(case: str, exported: Callable[[str], Exported]) -> None:
    """Where one GgufMatMul computes a layer's gate | up rows (one GGUF type), the engine
    graphs hold it with ``epilogue="swiglu"`` and no Split, Sigmoid or Mul after it (the
    export's figures count them). The adapter graphs, whose updates go to gate and up
    before the activation, split the product again and apply the library's Swiglu op to
    the halves (no epilogue there); GPT-2's plain MLP has none. The graphs compute the
    tokens the other tests check, and the export's adapter check finds a row without an
    adapter equal in both (1e-5)."""
    e = exported(case)
    layers = json.loads((e.ggml / "config.json").read_text("utf-8"))["n_layers"]
    gated = CASES[case].family != "gpt2"

    def counts(name: str) -> tuple[int, int]:
        graph = onnx.load(str(e.ggml / name), load_external_data=False).graph
        fused = sum(n.op_type == service.ops.MATMUL_OP and any(
            a.name == "epilogue" and a.s == b"swiglu" for a in n.attribute) for n in graph.node)
        return fused, sum(n.op_type == "Sigmoid" for n in graph.node)

    verification = json.loads((e.ggml / "manifest.json").read_text("utf-8"))["verification"]
    for name in ("engine.onnx", "engine_mixed.onnx"):  # (the row groups share the MLP)
        adapters = onnx.load(str(e.ggml / name.replace(".onnx", "_lora.onnx")),
                             load_external_data=False).graph
        # gate | up in one product where both are of one type (not mixed's Q8_0 | Q5_0,
        # nor kquants' Q4_K | Q6_K)
        joined = sum(n.op_type == service.ops.MATMUL_OP and n.name == f"l{i}.gate+l{i}.up"
                     for n in adapters.node for i in range(layers))
        assert counts(name) == (joined, layers - joined if gated else 0), name
        assert counts(name.replace(".onnx", "_lora.onnx")) == (0, layers - joined if gated
                                                                else 0), name
        assert sum(n.op_type == service.ops.SWIGLU_OP for n in adapters.node) == joined
        figures = verification[f"{name.removesuffix('.onnx')}_quantized"]
        assert figures["swiglu_epilogues"] == joined, name
    assert (joined > 0) == (case in ("q4_0", "q4_1"))


def test_refusals_write_nothing(exported: Callable[[str], Exported], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """--kernel ggml is refused in one line, nothing written, where it cannot apply (no
    --quantize gguf) or the op library is not built; --kernel auto, the default, then
    falls back to MatMulNBits, saying so; and a ggml artifact loaded without the library
    computes its blocks dequantised."""
    e = exported("q4_1")
    out = tmp_path / "out"

    def export(*args: str) -> tuple[int, list[str]]:
        code = cli_main(["export", "--ckpt", str(e.ckpt), "--out", str(out), "--engine-graph",
                         "--no-verify", *args])
        return code, capsys.readouterr().err.strip().splitlines()

    code, err = export("--kernel", "ggml")
    assert code == 2 and err and "needs --quantize gguf" in err[-1], err
    assert not out.exists()
    monkeypatch.setattr(service.ops, "library_path", lambda cache=None: None)
    code, err = export("--quantize", "gguf", "--kernel", "ggml")
    assert code == 2 and "make gguf-ops" in err[-1], err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    code, err = export("--quantize", "gguf")  # --kernel auto
    assert code == 0 and any("not built here" in line for line in err), err
    manifest = json.loads((out / "manifest.json").read_text("utf-8"))
    assert {g["kernel"] for g in manifest["graphs"]} == {"onnxruntime"}
    # the ggml artifact where the library cannot load: its blocks dequantised, the float32
    # model's arithmetic (the checkpoint's weights are those blocks dequantised)
    gpt = load_checkpoint(e.ckpt).model.eval()
    ids = np.random.default_rng(1).integers(3, gpt.config.vocab_size, (2, 16))
    with torch.no_grad():
        ref = gpt(torch.from_numpy(ids)).logits.float().numpy()  # (B, T, V)
    dec = OrtDecoder.from_artifact(e.ggml)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    got = dec(ids, np.ones_like(ids), pos, dec.empty_past(2))[0]
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 1e-4


@pytest.fixture(scope="module")
def float_exported(exported: Callable[[str], Exported], tmp_path_factory: pytest.TempPathFactory
                   ) -> Callable[[str], Path]:
    """--kernel ggml --activations float (the default model's export), verified."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            e = exported(name)
            with torch_threads(1):
                cache[name] = export_artifact(
                    e.ckpt, tmp_path_factory.mktemp(f"kernel-float-{name}") / "art",
                    quantize="gguf", engine_graph=True, kernel="ggml", activations="float")
        return cache[name]

    return get


@pytest.mark.parametrize("case", ["q4_1", "kquants"])
def test_float_activations_compute_the_float32_model_over_the_same_bytes(
        case: str, exported: Callable[[str], Exported],
        float_exported: Callable[[str], Path]) -> None:
    """--activations float under ggml's kernels: every GgufMatMul keeps X in float32
    (activations="float"), the served graphs are the ones verified against PyTorch by the
    float32 rule, their logits within float32 noise of the checkpoint's (the int8 ones 2-3%
    away), and weights.bin is the int8 artifact's bytes: the same rows, nothing split."""
    e, art = exported(case), float_exported(case)
    manifest = json.loads((art / "manifest.json").read_text("utf-8"))
    assert manifest["verification"]["passed"] is True
    assert manifest["verification"]["engine_quantized"]["activations"] == "float"
    for graph in ("model.onnx", "attention.onnx", ENGINE_FILE, ENGINE_MIXED_FILE):
        products = [n for n in onnx.load(str(art / graph), load_external_data=False).graph.node
                    if n.op_type == service.ops.MATMUL_OP]
        assert products and all(
            next(a.s for a in n.attribute if a.name == "activations") == b"float"
            and layout(n) == "rows" for n in products), graph
    assert (art / "weights.bin").stat().st_size == (e.ggml / "weights.bin").stat().st_size
    gpt = load_checkpoint(e.ckpt).model.eval()
    ids = np.random.default_rng(1).integers(3, gpt.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = gpt(torch.from_numpy(ids)).logits.float().numpy()  # (B, T, V)
    eng = EngineDecoder(art / ENGINE_FILE, gpt)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    got = eng(ids, np.ones_like(ids), pos, eng.empty_past(2))[0]
    rel = float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()))
    print(f"{case}: engine.onnx at float activations {rel:.2e} from PyTorch")
    assert rel < 1e-4  # float32 summation order; int8 activations: 2e-2 (test above)
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
