"""The attention viewer's server side: attention.onnx and what /attention and /viz need."""
