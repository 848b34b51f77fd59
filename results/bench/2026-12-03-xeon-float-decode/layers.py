"""120 SmolLM2-shaped Q4_1 products in one graph (30 layers x qkv, o, gate+up, down), b1."""
import os, sys, time
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import service.ops
from benchmarks.gguf_matmul_speed import gguf_weights

rng = np.random.default_rng(0)
import json; shapes = json.loads(os.environ.get("SHAPES", "[[960,576],[576,576],[3072,576],[576,1536]]"))
acts = sys.argv[1] if len(sys.argv) > 1 else "float"
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
path = sys.argv[3] if len(sys.argv) > 3 else None
layers = int(os.environ.get("LAYERS", 30))
ws = [gguf_weights("Q4_1", n, k, rng) for n, k in shapes]
nodes, inits, outs = [], [], []
total = 0
for l in range(layers):
    for j, (n, k) in enumerate(shapes):
        tid, stored, _ = ws[j]
        name = f"W{l}_{j}"
        inits.append(numpy_helper.from_array(stored.copy(), name)); total += stored.nbytes
        x = "X2" if k == 1536 else "X"
        nodes.append(helper.make_node(service.ops.MATMUL_OP, [x, name], [f"Y{l}_{j}"],
                     domain=service.ops.DOMAIN, ggml_type=tid, k=k, activations=acts))
        outs.append(helper.make_tensor_value_info(f"Y{l}_{j}", TensorProto.FLOAT, [1, n]))
g = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 576]),
                                        helper.make_tensor_value_info("X2", TensorProto.FLOAT, [1, 1536])],
                      outs, initializer=inits)
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(service.ops.DOMAIN, 1)])
if path: os.environ["ATTNSERVE_GGUF_MATMUL_PATH"] = path
o = ort.SessionOptions(); o.intra_op_num_threads = threads; o.inter_op_num_threads = 1
assert service.ops.register(o)
if os.environ.get("PROF"): o.enable_profiling = True
s = ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
feed = {"X": rng.standard_normal((1, 576), dtype=np.float32), "X2": rng.standard_normal((1, 1536), dtype=np.float32)}
for _ in range(20): s.run(None, feed)
ts = []
for _ in range(200):
    t = time.perf_counter(); s.run(None, feed); ts.append(time.perf_counter() - t)
med = float(np.median(ts))
print(f"{acts} threads={threads} path={path}: {med*1e3:.3f} ms for {len(nodes)} products ({total/1e6:.1f} MB): "
      f"{med/len(nodes)*1e6:.1f} us each, {total/med/1e9:.1f} GB/s")
