"""HTTP routes, one APIRouter per resource; none of them touches onnxruntime."""
