"""``--kv-dtype`` (export/gguf/half_cache.py, export/to_onnx.py ``check_kv_dtype``): which
exports may take a float16 cache and which get it by default, and the retyping refused, the
file untouched, where anything but CachedAttention touches a cache. The served graphs
themselves: tests/service/test_half_cache_serving.py."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from export.gguf.half_cache import halve_cache
from export.to_onnx import check_kv_dtype
from service import ops

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16


def attention_graph(path: Path, extra_reader: bool = False) -> Path:
    """One CachedAttention over past_key_values.0.* (and, with ``extra_reader``, a Shape of
    its past key beside it), saved at ``path``."""
    names = ["query", "", "", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k",
             "total_sequence_length"]
    nodes = [helper.make_node(ops.ATTENTION_OP, names, ["out", "present.0.key",
                                                        "present.0.value"],
                              domain=ops.DOMAIN, name="l0.gqa", num_heads=2, kv_num_heads=1)]
    outputs = ["out", "present.0.key", "present.0.value"]
    if extra_reader:
        nodes.append(helper.make_node("Shape", ["past_key_values.0.key"], ["length"],
                                      name="length"))
        outputs.append("length")
    types = {"seqlens_k": TensorProto.INT32, "total_sequence_length": TensorProto.INT32,
             "length": TensorProto.INT64}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, types.get(n, FLOAT), None)
                     for n in names if n],
        [helper.make_tensor_value_info(n, types.get(n, FLOAT), None) for n in outputs])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid(ops.DOMAIN, 1)]),
                    str(path))
    return path


def cache_types(path: Path) -> dict[str, int]:
    graph = onnx.load(str(path)).graph
    return {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output)
            if v.name.startswith(("past", "present"))}


def test_the_caches_retyped_and_nothing_else(tmp_path: Path) -> None:
    path = attention_graph(tmp_path / "engine.onnx")
    assert halve_cache(path) == 4
    assert set(cache_types(path).values()) == {HALF}
    graph = onnx.load(str(path)).graph
    assert {v.name: v.type.tensor_type.elem_type for v in graph.input}["query"] == FLOAT
    assert [n.op_type for n in graph.node] == [ops.ATTENTION_OP]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.onnx"]  # no staged file


def test_a_cache_read_by_another_node_is_refused_untouched(tmp_path: Path) -> None:
    path = attention_graph(tmp_path / "engine.onnx", extra_reader=True)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"engine.onnx: a float16 KV cache needs its caches "
                                         r"read and written by CachedAttention alone \(also "
                                         r"by length\)"):
        halve_cache(path)
    assert path.read_bytes() == before


def allowed(kv_dtype: str | None, dtype: str = "float32", engine_graph: bool = True,
            kernel: str = "ggml", level: int = 1, from_blocks: bool = True) -> str | None:
    return check_kv_dtype(kv_dtype, dtype, engine_graph, kernel,  # type: ignore[arg-type]
                          level, from_blocks)


def test_which_exports_take_a_float16_cache() -> None:
    assert allowed("float16") == "float16" and allowed("float32") is None
    assert allowed("float16", dtype="float16") is None  # a float16 artifact's own cache
    # the default: float16 wherever it can be written, else the weights' dtype's, unsaid
    assert allowed(None) == "float16"
    for elsewhere in (allowed(None, kernel="nbits"), allowed(None, engine_graph=False),
                      allowed(None, level=0), allowed(None, from_blocks=False),
                      allowed(None, dtype="float16")):
        assert elsewhere is None
    with pytest.raises(ValueError, match="--dtype float16 keeps its KV cache in float16"):
        allowed("float32", dtype="float16")
    with pytest.raises(ValueError, match="unsupported kv_dtype 'bfloat16'"):
        allowed("bfloat16")
    refusal = r"--kv-dtype float16 \(with float32 weights\) needs --engine-graph --quantize gguf"
    with pytest.raises(ValueError, match=refusal):
        allowed("float16", kernel="nbits")
    with pytest.raises(ValueError, match=refusal):
        allowed("float16", engine_graph=False)
    with pytest.raises(ValueError, match=refusal):
        allowed("float16", level=0)  # float activations: served = the verified graphs
    with pytest.raises(ValueError, match=refusal):
        allowed("float16", from_blocks=False)  # a float32 twin, or converted blocks
