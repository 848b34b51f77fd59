"""A copy of an artifact whose engine graphs get the SwiGLU epilogue (export/gguf/blocks.py's
_fused_swiglu), weights.bin hard-linked: the same weights, only the graphs differ."""
import os, shutil, sys
from pathlib import Path
import onnx
from export.gguf.blocks import _fused_swiglu
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    target = dst / f.name
    if target.exists():
        target.unlink()
    if f.name in ("engine.onnx", "engine_mixed.onnx"):
        m = onnx.load(str(f), load_external_data=False)
        n = _fused_swiglu(m.graph)
        onnx.save(m, str(target))
        print(f.name, "fused", n)
    elif f.name == "weights.bin":
        os.link(f, target)
    else:
        shutil.copy2(f, target)
import hashlib, json
manifest = json.loads((dst / "manifest.json").read_text())
for name in ("engine.onnx", "engine_mixed.onnx"):
    data = (dst / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
(dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
