"""Half precision: an artifact's graphs rewritten in float16, for ONNX Runtime's CUDA provider.

``export --dtype float16`` builds every graph in float32 as usual, then rewrites each one
with ONNX Runtime's own converter (``onnxruntime.transformers.float16``): weights,
activations and the KV cache in float16, half the bytes a decode step streams, and the
types the CUDA provider's fused kernels want (its GroupQueryAttention takes float16 or
bfloat16 only). What stays float32, and why:

- **logits**, as the I/O contract says (io_spec.py): sampling and log-probabilities
  subtract numbers near each other, and the head's float16 products are cast up once;
- **attention.onnx's inputs and outputs**: introspection, read by tools in float32;
- **model.onnx's and attention.onnx's norms and rotary angles**, written there as
  primitive ops (export/graphs.py): a mean of squares overflows float16 (65,504) once the
  residual stream passes 256, which real models' outlier channels do, and a rotary angle
  ``position × inv_freq`` keeps three significant digits in float16, a whole radian's
  error from position 2,048 on. engine.onnx needs none of that: its fused norms
  accumulate in float32, and GroupQueryAttention reads float16 cos/sin tables, values in
  [−1, 1] computed in float32 and rounded once.

Float16 rather than bfloat16: the CUDA provider's GroupQueryAttention, MatMul and norms
serve both, float16 keeps three more bits of mantissa at the same speed, and the models
this project serves keep their activations far inside float16's range once the norms
are float32 (bfloat16 is worth it where a model overflows float16; none here does).

The engine graphs also return each row's greedy choice (``greedy_ids``, an ArgMax of the
float32 logits), so a greedy decode step on the GPU sends token ids to the host instead
of a (B, V) logits array (service/engine/device.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from export.onnx_build import WeightsWriter, load_graph
from service.contract import engine_spec as es
from service.contract import io_spec as io

# float16's unit roundoff (10 stored mantissa bits): a value rounded to float16 moves by
# at most this fraction of itself
HALF_UNIT_ROUNDOFF = 2.0 ** -11
# the graphs' primitive-op norms and rotary angles, by node name (export/graphs.py,
# model/architectures/): kept float32 in model.onnx and attention.onnx
_NORM_PARTS = frozenset({"ln1", "ln2", "ln_f"})  # l{i}.ln1.sq, …, ln_f.unit
_ROTARY_NODES = frozenset({"pos_f", "pos_col"})  # positions as floats, then rope.*
_SIDE_DATA = ".half.data"


def float32_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes that compute norms or rotary angles from primitive ops."""
    def kept(name: str) -> bool:
        parts = name.split(".")
        return parts[0] == "rope" or name in _ROTARY_NODES or not _NORM_PARTS.isdisjoint(parts)

    return [n.name for n in model.graph.node if kept(n.name)]


def halve(model: onnx.ModelProto, file_name: str) -> onnx.ModelProto:
    """``model`` (its weights loaded) in float16, except what the module docstring keeps
    float32; an engine graph gains its ``greedy_ids`` output(s)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    engine = file_name in (es.ENGINE_FILE, es.ENGINE_MIXED_FILE)
    outputs = {o.name for o in model.graph.output}
    logits = [name for name in (io.LOGITS, es.chunk_name(io.LOGITS)) if name in outputs]
    keep_io: bool | list[str] = True if file_name == io.ATTENTION_FILE else logits
    half = convert_float_to_float16(
        model, keep_io_types=keep_io, disable_shape_infer=True,
        node_block_list=[] if engine else float32_nodes(model))
    if engine:
        _add_greedy_ids(half, logits)
    return half


def _add_greedy_ids(model: onnx.ModelProto, logits: list[str]) -> None:
    """``greedy_ids`` (B, K) int64 = argmax over the vocabulary of each float32 logits
    output (``chunk.greedy_ids`` for the mixed graph's second group)."""
    for name in logits:
        out = es.GREEDY_IDS if name == io.LOGITS else es.chunk_name(es.GREEDY_IDS)
        model.graph.node.append(helper.make_node("ArgMax", [name], [out], name=f"{out}.argmax",
                                                 axis=-1, keepdims=0))
        model.graph.output.append(helper.make_tensor_value_info(
            out, TensorProto.INT64, _batch_and_positions(model, name)))


def _batch_and_positions(model: onnx.ModelProto, logits: str) -> list[str | int | None]:
    """The logits output's first two dimensions, (B, K), as the graph declares them."""
    for o in model.graph.output:
        if o.name == logits:
            dims = o.type.tensor_type.shape.dim[:2]
            return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                    for d in dims]
    raise ValueError(f"no output {logits}")


def halve_artifact(directory: Path, files: list[str],
                   say: Callable[[str], None] = lambda _msg: None) -> dict[str, int]:
    """Rewrite each graph of ``files`` in ``directory`` in float16, then store every
    graph's weights in one weights.bin again (the float32 ones are dropped: no graph reads
    them any more). Returns the float16 weight bytes now stored."""
    for name in files:
        path = directory / name
        model = onnx.load(str(path))  # its weights, from weights.bin
        if name not in (es.ENGINE_FILE, es.ENGINE_MIXED_FILE):
            # the converter casts around the float32 nodes by their inputs' types: infer
            # them on the graph without its weights (a proto of over 2 GB cannot be)
            model.graph.value_info.extend(
                onnx.shape_inference.infer_shapes(load_graph(path)).graph.value_info)
        half = halve(model, name)
        del model
        side = path.with_name(path.name + _SIDE_DATA)
        side.unlink(missing_ok=True)
        onnx.save_model(half, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=side.name, size_threshold=1024)
        del half
        say(f"{name} in float16")
    with WeightsWriter(directory, base=directory) as weights:
        for path in sorted(directory.glob("*.onnx")):
            weights.add(path.name, load_graph(path))
    for side in directory.glob(f"*{_SIDE_DATA}"):
        side.unlink()
    return weights.figures
