"""The ``smollm2-135m-instruct`` preset: the real SmolLM2-135M-Instruct, one GGUF file
served by every engine.

The source is the shipped ``SmolLM2-135M-Instruct.Q4_1.gguf`` (``make default-model``;
model/default_model.py finds it). From that one file:

- llama.cpp runs the file itself (Q4_1 matrices, Q8_0 embedding), an f32 copy with every
  tensor dequantised (benchmarks/lib/gguf_export.py) and llama.cpp's own q8_0 of that copy;
- ``attnserve import --gguf`` dequantises it into our checkpoint
  (``checkpoints/smollm2-135m-instruct`` when present, else imported into the work
  directory), which we export fp32, int8, int4 and ``--quantize gguf`` (the file's own
  blocks), and which ``attnserve export --format hf`` writes for transformers and
  CTranslate2.

So llama.cpp f32, our fp32, transformers and CTranslate2 fp32 compute with the same
dequantised weights; prompts are cut from the stdlib corpus with SmolLM2's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # not from prepare.py, which imports this

PRESET = "smollm2-135m-instruct"
CHECKPOINT = REPO_ROOT / "checkpoints" / "smollm2-135m-instruct"


def source_gguf() -> Path:
    """The shipped Q4_1 file; a one-line error naming the install command when missing."""
    from model.default_model import default_gguf_path, install_hint

    path = default_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"{PRESET}: {path} is not installed ({install_hint()})")
    return path


def prepare_smollm2_instruct(work: Path) -> tuple[Path, Path, str]:
    """(checkpoint, source GGUF, description): the imported checkpoint, reused when the
    repository already holds it, else imported from the file into ``work``."""
    gguf = source_gguf()
    if (CHECKPOINT / "config.json").is_file():
        ckpt = CHECKPOINT
    else:
        from model.gguf.to_checkpoint import import_gguf_checkpoint

        ckpt = work / "ckpt"
        if not (ckpt / "config.json").is_file():
            import_gguf_checkpoint(gguf, ckpt, force=True)
    where = ckpt.relative_to(REPO_ROOT) if ckpt.is_relative_to(REPO_ROOT) else ckpt
    return ckpt, gguf, (f"SmolLM2-135M-Instruct, {gguf.name} (Q4_1 matrices, Q8_0 embedding) "
                        f"as shipped; dequantised by attnserve import into {where}")

