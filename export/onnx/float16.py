"""Half precision: the engine graphs rewritten in float16, for ONNX Runtime's CUDA provider.

``export --dtype float16`` builds every graph in float32 as usual, then rewrites the
served graphs (engine.onnx, engine_mixed.onnx) with ONNX Runtime's own converter
(``onnxruntime.transformers.float16``): weights, activations and the KV cache in float16,
half the bytes a decode step streams, and the types the CUDA provider's fused kernels want
(its GroupQueryAttention takes float16 or bfloat16 only). What stays float32, and why:

- **logits**, as the I/O contract says (io_spec.py): sampling and log-probabilities
  subtract numbers near each other, and the head's float16 products are cast up once;
- **model.onnx and attention.onnx** (the reference and introspection graphs): their
  norms and rotary angles are primitive ops (export/onnx/model_graphs.py), where a mean of squares
  overflows float16 (65,504) once the residual stream passes 256 and a rotary angle
  ``position × inv_freq`` keeps three significant digits. engine.onnx needs none of that:
  its fused norms accumulate in float32, and GroupQueryAttention reads float16 cos/sin
  tables, values in [−1, 1] computed in float32 and rounded once.

Float16 rather than bfloat16: the CUDA provider's GroupQueryAttention, MatMul and norms
serve both, float16 keeps three more bits of mantissa at the same speed, and the models
this project serves keep their activations far inside float16's range once the norms
are float32 (bfloat16 is worth it where a model overflows float16; none here does).

The engine graphs also return each row's greedy choice (``greedy_ids``, an ArgMax of the
float32 logits), so a greedy decode step on the GPU sends token ids to the host instead
of a (B, V) logits array (service/engine/cuda.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from export.onnx.onnx_build import WeightsWriter, load_graph
from service.contract import engine_spec as es
from service.contract import io_spec as io

_SIDE_DATA = ".half.data"


def halve(model: onnx.ModelProto) -> onnx.ModelProto:
    """An engine graph ``model`` (its weights loaded) in float16 but for its float32
    logits, with its ``greedy_ids`` output(s) added."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    outputs = {o.name for o in model.graph.output}
    logits = [name for name in (io.LOGITS, es.chunk_name(io.LOGITS)) if name in outputs]
    half = convert_float_to_float16(model, keep_io_types=logits, disable_shape_infer=True)
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
                   say: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    """Rewrite each engine graph of ``files`` in ``directory`` in float16, then store every
    graph's weights in one weights.bin again (float32 tensors only the rewritten graphs
    read are dropped). Returns the new weights.bin's figures (WeightsWriter.figures)."""
    for name in files:
        path = directory / name
        model = onnx.load(str(path))  # its weights, from weights.bin
        half = halve(model)
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
