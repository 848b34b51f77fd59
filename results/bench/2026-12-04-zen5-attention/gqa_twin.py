"""An artifact's twin that runs ONNX Runtime's GroupQueryAttention where it runs CachedAttention.

    python gqa_twin.py ARTIFACT TWIN

TWIN holds ARTIFACT's files as hard links (weights.bin included: the same weights, read from
the same file; ONNX Runtime refuses external data behind a symbolic link out of the folder),
except the graphs with CachedAttention nodes, which are copied with each such node made the
com.microsoft GroupQueryAttention it stands for (the same inputs, outputs and attributes),
and manifest.json, whose entries for those graphs get their new sizes and sha256. So an A/B
of the two differs in the attention kernel only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import onnx


def main(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=False)
    manifest = json.loads((src / "manifest.json").read_text("utf-8"))
    for path in sorted(src.iterdir()):
        if path.name == "manifest.json":
            continue
        if path.suffix == ".onnx":
            model = onnx.load(str(path), load_external_data=False)
            swapped = 0
            for node in model.graph.node:
                if node.op_type == "CachedAttention":
                    node.op_type, node.domain = "GroupQueryAttention", "com.microsoft"
                    swapped += 1
            if swapped:
                onnx.save(model, str(dst / path.name))
                data = (dst / path.name).read_bytes()
                manifest["files"][path.name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                                "size": len(data)}
                print(f"{path.name}: {swapped} nodes")
                continue
        os.link(path, dst / path.name)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
