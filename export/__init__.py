"""Checkpoint → artifacts; the only package that knows both PyTorch and ONNX.

``to_onnx`` writes the verified ONNX artifact the service runs (``from_blocks`` when a
checkpoint's GGUF file is kept as blocks), ``to_hf`` a transformers copy, ``cli``
``attnserve export``, ``eval`` and ``steer`` (``steer``: a control vector from prompt
pairs); ``memory`` returns what a stage freed to the system. Subpackages by product:
``onnx`` the graphs, ``quantize`` their quantised weights, ``gguf`` GGUF in and out,
``lora`` adapter graphs, ``verify`` parity checks and perplexity. Artifacts go through the
torch-free ``service.contract``; the service never imports this package.
"""
