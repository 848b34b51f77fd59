"""Figures an artifact is judged by: parity with PyTorch (``parity``; the engine graphs',
``engine_parity``; layer by layer for a large model, ``layerwise``), perplexity and bits per
byte (``evaluate``, ``attnserve eval``)."""
