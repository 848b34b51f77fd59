"""The graphs, node by node over one weights.bin (``onnx_build``): model.onnx and
attention.onnx (``model_graphs``), engine.onnx and engine_mixed.onnx (``engine_graph``),
the engine graphs in float16 (``float16``), the logit-lens graph (``lens_graph``), and the
nodes of a layer that every graph shares (``layers``)."""
