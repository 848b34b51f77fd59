"""FastAPI + ONNX Runtime serving. Never imports torch: the serving image has none."""
