"""torch → ONNX export. Only this package knows both PyTorch and ONNX.

It writes artifacts through the torch-free contract in ``service.contract`` (I/O names,
artifact config, manifest); the service never imports this package.
"""
