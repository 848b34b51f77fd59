"""torch → ONNX export. Only this package knows both PyTorch and ONNX.

The submodules ``io_spec`` and ``manifest`` are torch-free: the service imports them.
"""
