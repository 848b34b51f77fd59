"""A float16 KV cache for the CPU engine graphs over the GGUF ops (``--kv-dtype float16``).

In the engine graphs the export writes over the GGUF ops, the past / present caches are read
and written by the op library's CachedAttention alone (export/gguf/blocks.py swaps it in
for GroupQueryAttention), which also has a kernel over a float16 cache
(service/ops/cached_attention.cc): each new key and value rounded to float16 once, every
product in float32. So a float16 cache is the same graph with those inputs and outputs
retyped: no node changes, no Cast, and the pool the service keeps for it is half the
bytes, as is what a decode step streams from it (llama.cpp's default cache is f16 too).
At 1,000 cached positions that made a 1B Llama's attention 1.6x faster at batch 32
(docs/kernels.md).

What keeps a float32 cache: model.onnx (the I/O contract graph, whose attention is
primitive ops), the graphs the export verifies against PyTorch (the cache's rounding is
judged where the served graph is judged against them: token agreement and perplexity),
and a float32 twin (ONNX Runtime's GroupQueryAttention takes one type for the query and
the cache, so it could not share a float16 pool; the export refuses the pair).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from service import ops


def halve_cache(path: Path) -> int:
    """Retype the graph at ``path`` (its weights left where they are) so that its KV cache
    inputs and outputs are float16; returns how many were retyped. ValueError, the graph
    untouched, where any of them is read or written by a node other than CachedAttention
    (in the cache's slots), or there is none."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    attention = [n for n in graph.node if n.op_type == ops.ATTENTION_OP and n.domain == ops.DOMAIN]
    caches = {name for n in attention for name in n.input[3:5]} | {
        name for n in attention for name in n.output[1:3]}
    others = [n.name for n in graph.node if n not in attention
              and caches & {*n.input, *n.output}]
    if not caches or others:
        raise ValueError(f"{path.name}: a float16 KV cache needs its caches read and written "
                         f"by {ops.ATTENTION_OP} alone" + (
                             f" (also by {', '.join(others[:3])})" if others else
                             f" (it has no {ops.ATTENTION_OP})"))
    ends = [v for v in (*graph.input, *graph.output) if v.name in caches]
    if {v.name for v in ends} != caches:
        raise ValueError(f"{path.name}: a {ops.ATTENTION_OP} cache is not a graph input or "
                         "output")
    for value in ends:
        value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    staged = path.with_name(f".{path.name}.half")
    onnx.save_model(model, str(staged))
    staged.replace(path)
    return len(ends)
