"""LoRA adapter graphs: the ``*_lora.onnx`` rewrites that add each row's adapter update
(``adapter_graph``), and their check against PyTorch and the base graph (``adapter_check``)."""
