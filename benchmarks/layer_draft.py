"""A draft model cut from the target itself: its first K layers, its final norm, its head.

Draft-model speculation needs a smaller model with the target's tokenizer. For the real
SmolLM2-135M-Instruct none ships here (the family's next size down does not exist), so
this makes the one every model has: the early-exit draft of self-speculative decoding
(LayerSkip, Draft & Verify), with no training. It shares the tokenizer, vocabulary,
embedding and head with the target, so the server accepts it as ``--speculative-model``.
Untrained early exits agree with the full model less often than a trained small model
would; the benchmark measures how often, and speculation's cost-aware pauses decide
whether drafting pays.

Usage:
    python -m benchmarks.layer_draft --ckpt checkpoints/smollm2-135m-instruct --layers 8 \
        --out .cache/drafts/smollm2-8-layers
    python -m benchmarks.speculative --artifact artifacts/smollm2-135m-instruct \
        --draft .cache/drafts/smollm2-8-layers
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

# Files an imported checkpoint carries beside its weights (chat template, sampling).
CARRIED = ("chat_template.jinja", "generation_config.json", "tokenizer_config.json")


def cut_checkpoint(ckpt: Path, layers: int, out: Path) -> Path:
    """Write a checkpoint of ``ckpt``'s first ``layers`` blocks (atomically)."""
    from model.checkpoint import load_checkpoint, save_checkpoint
    from model.gpt import GPT

    source = load_checkpoint(ckpt)
    total = source.meta.model.n_layers
    if not 1 <= layers < total:
        raise ValueError(f"--layers must be in 1..{total - 1} (the model has {total})")
    config = dataclasses.replace(source.meta.model, n_layers=layers)
    draft = GPT(config)
    # The first `layers` blocks, the embedding, final norm and head: the target's own.
    missing, unexpected = draft.load_state_dict(source.model.state_dict(), strict=False)
    kept_out = [k for k in unexpected if not k.startswith("blocks.")]
    if missing or kept_out:
        raise ValueError(f"cannot cut {ckpt}: missing {missing}, unexpected {kept_out}")
    meta = dataclasses.replace(source.meta, model=config, training={
        **source.meta.training, "draft_of": {"checkpoint": str(ckpt), "layers": layers,
                                             "of": total}})
    extra = {name: (ckpt / name).read_bytes() for name in CARRIED if (ckpt / name).is_file()}
    return save_checkpoint(out, draft, meta, source.tokenizer_path.read_text("utf-8"),
                           extra_files=extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, required=True, help="the target's checkpoint")
    p.add_argument("--layers", type=int, required=True, help="blocks the draft keeps")
    p.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    p.add_argument("--force", action="store_true", help="replace --out")
    args = p.parse_args(argv)
    if args.out.exists() and not args.force:
        print(f"layer_draft: error: {args.out} exists (--force replaces it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="layer-draft-") as tmp:
        try:
            ckpt = cut_checkpoint(args.ckpt, args.layers, Path(tmp) / "ckpt")
        except (ValueError, OSError) as exc:
            print(f"layer_draft: error: {exc}", file=sys.stderr)
            return 2
        export = [sys.executable, "-m", "service.cli", "export", "--ckpt", str(ckpt),
                  "--out", str(args.out), "--engine-graph", "--no-mixed-steps"]
        if args.force:
            export.append("--force")
        code = subprocess.call(export)
    if code == 0:
        print(f"draft artifact ({args.layers} layers of {args.ckpt}): {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
