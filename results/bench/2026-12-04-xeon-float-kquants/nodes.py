import numpy as np, onnx, onnxruntime as ort, time
from onnx import helper, TensorProto
def chain(op, n, d=576):
    nodes=[]; prev="x"
    inits=[helper.make_tensor("c", TensorProto.FLOAT, [d], np.ones(d, np.float32)*0.999)]
    for i in range(n):
        out=f"t{i}"
        if op=="Mul": nodes.append(helper.make_node("Mul",[prev,"c"],[out]))
        elif op=="Sigmoid": nodes.append(helper.make_node("Sigmoid",[prev],[out]))
        prev=out
    nodes.append(helper.make_node("Identity",[prev],["y"]))
    g=helper.make_graph(nodes,"g",[helper.make_tensor_value_info("x",TensorProto.FLOAT,[1,d])],[helper.make_tensor_value_info("y",TensorProto.FLOAT,[1,d])],inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("",17)])
for threads in (1,2):
  for op in ("Mul","Sigmoid"):
    for n in (10, 500):
        o=ort.SessionOptions(); o.intra_op_num_threads=threads; o.graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        s=ort.InferenceSession(helper.make_model(chain(op,n).graph, opset_imports=[helper.make_opsetid("",17)]).SerializeToString(), o, providers=["CPUExecutionProvider"])
        x=np.random.rand(1,576).astype(np.float32)
        for _ in range(50): s.run(None,{"x":x})
        ts=[]
        for _ in range(300):
            t=time.perf_counter(); s.run(None,{"x":x}); ts.append(time.perf_counter()-t)
        print(threads, op, n, f"{np.median(ts)*1e3:.3f} ms", f"{np.median(ts)/n*1e6:.2f} us/node")
