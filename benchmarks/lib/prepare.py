"""Everything the engines share: one checkpoint per preset, its copies, and the prompts.

The weights are a trained checkpoint when one is given (or ``checkpoints/default`` for
the ``small`` preset, when it matches), otherwise the preset initialised at random with a
fixed seed: tokens/s do not depend on the weight values, but greedy agreement figures
(int8) on random weights say little, and the report says which it was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.checkpoint import read_meta

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CKPT = REPO_ROOT / "checkpoints" / "default"


@dataclass
class Prepared:
    preset: str
    ckpt: Path
    weights: str  # "trained (<path>)" or "random init (seed 0)"
    params: int
    model_config: dict[str, Any]
    paths: dict[str, str] = field(default_factory=dict)  # hf, artifact, artifact_int8, ...
    notes: list[str] = field(default_factory=list)


def _matches_preset(ckpt: Path, preset: str) -> bool:
    from model.config import PRESETS

    try:
        m = read_meta(ckpt).model
    except ValueError:
        return False
    p = PRESETS.get(preset)
    return p is not None and (m.d_model, m.n_heads, m.n_layers, m.d_ff) == (
        p.d_model, p.n_heads, p.n_layers, p.d_ff)


def _tokenizer_json(work: Path) -> str:
    """The default checkpoint's tokenizer, else a byte-level BPE trained on the stdlib corpus."""
    if (DEFAULT_CKPT / "tokenizer.json").is_file():
        return (DEFAULT_CKPT / "tokenizer.json").read_text(encoding="utf-8")
    cached = work / "tokenizer.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    from model.tokenizer import train_bpe_tokenizer

    text = _corpus_text()
    tok = train_bpe_tokenizer([text[i:i + 4000] for i in range(0, len(text), 4000)])
    work.mkdir(parents=True, exist_ok=True)
    cached.write_text(tok.to_str(), encoding="utf-8")
    return tok.to_str()


def _corpus_text() -> str:
    """The built-in stdlib corpus: the prompts and the tokenizer come from real prose."""
    from model.data import read_documents, stdlib_corpus_path

    return "\n\n".join(read_documents(stdlib_corpus_path()))


def random_checkpoint(preset: str, out: Path, tokenizer_json: str) -> Path:
    import torch
    from tokenizers import Tokenizer

    from model.checkpoint import CheckpointMeta, save_checkpoint
    from model.config import config_from_preset
    from model.gpt import GPT
    from model.tokenizer import special_ids

    tok = Tokenizer.from_str(tokenizer_json)
    config = config_from_preset(preset, vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    model = GPT(config).eval()
    meta = CheckpointMeta(model=config, tokenizer={"kind": "bpe", **special_ids(tok).to_dict()},
                          training={"note": "random init for benchmarking, seed 0"})
    return save_checkpoint(out, model, meta, tokenizer_json)


def prepare_checkpoint(preset: str, work: Path, given: Path | None) -> Prepared:
    hf: Path | None = None
    gguf: Path | None = None
    if given is not None:
        ckpt, weights = given, f"trained ({given})"
    elif preset == "gpt2":
        from benchmarks.lib.gpt2_preset import prepare_gpt2

        ckpt, hf, weights = prepare_gpt2(work)
    elif preset == "smollm2-135m":
        from benchmarks.lib.smollm2_preset import prepare_smollm2

        ckpt, hf, weights = prepare_smollm2(work)
    elif preset == "smollm2-135m-instruct":
        from benchmarks.lib.smollm2_instruct_preset import prepare_smollm2_instruct

        ckpt, gguf, weights = prepare_smollm2_instruct(work)
    elif preset == "small" and _matches_preset(DEFAULT_CKPT, preset):
        ckpt, weights = DEFAULT_CKPT, f"trained ({DEFAULT_CKPT.relative_to(REPO_ROOT)})"
    else:
        ckpt = random_checkpoint(preset, work / "ckpt", _tokenizer_json(work.parent))
        weights = "random init (seed 0)"
    meta = read_meta(ckpt)
    prep = Prepared(preset=preset, ckpt=ckpt, weights=weights,
                    params=_count_params(ckpt), model_config=meta.model.to_dict())
    if hf is not None:  # the peers convert the very directory our checkpoint came from
        prep.paths["hf"] = str(hf)
    if gguf is not None:  # llama.cpp runs the very file our checkpoint was imported from
        prep.paths["gguf_q4_1"] = str(gguf)
    return prep


def _count_params(ckpt: Path) -> int:
    from model.checkpoint import load_checkpoint

    return int(load_checkpoint(ckpt).model.num_params())


def make_prompts(tokenizer_path: Path, count: int, length: int) -> dict[str, Any]:
    """``count`` prompts of exactly ``length`` tokens whose text re-encodes to the same ids,
    so engines fed ids and the HTTP service fed text see the same prompt."""
    from tokenizers import Tokenizer

    from model.tokenizer import decode, encode

    tok = Tokenizer.from_file(str(tokenizer_path))
    text = _corpus_text()
    ids_out: list[list[int]] = []
    texts: list[str] = []
    start, stride = 0, max(1, len(text) // (count * 4))
    while len(ids_out) < count and start < len(text):
        ids = encode(tok, text[start:start + 40 * length])[:length]
        start += stride
        if len(ids) < length:
            continue
        piece = decode(tok, ids, skip_special_tokens=False)
        if encode(tok, piece) == ids and piece.strip():
            ids_out.append(ids)
            texts.append(piece)
    if len(ids_out) < count:
        raise ValueError(f"could not cut {count} prompts of {length} tokens from the corpus")
    return {"ids": ids_out, "texts": texts}


# Artifact key → the export's --quantize method (None: fp32).
ARTIFACT_KINDS: dict[str, str | None] = {"artifact": None, "artifact_int8": "int8",
                                         "artifact_int4": "int4", "artifact_gguf": "gguf"}


def export_copies(prep: Prepared, work: Path, artifacts: dict[str, Path | None],
                  needed: set[str], log: Any) -> None:
    """The transformers copy, and the artifacts in ``needed`` (``ARTIFACT_KINDS``) unless
    given; a complete one already in ``work`` (a reused ``--work`` directory) is kept."""
    from export.to_hf import export_hf

    prep.paths["ckpt"] = str(prep.ckpt)
    if "hf" not in prep.paths:
        hf = work / "hf"
        done = (hf / "model.safetensors").is_file() and (hf / "config.json").is_file()
        prep.paths["hf"] = str(hf if done else export_hf(prep.ckpt, hf, force=True))
    trained = not prep.weights.startswith("random")
    for key, quantize in ARTIFACT_KINDS.items():
        if artifacts.get(key) is not None:
            prep.paths[key] = str(artifacts[key])
            continue
        if key not in needed:
            continue
        if (work / key / "manifest.json").is_file():
            prep.paths[key] = str(work / key)
            continue
        try:
            from export.to_onnx import export_artifact
        except ModuleNotFoundError as exc:
            prep.notes.append(f"{key}: not built, export.to_onnx unavailable ({exc})")
            continue
        try:
            # Verification compares greedy paths, which near-ties on random weights can
            # fail for reasons that have nothing to do with speed; skip it there.
            out = export_artifact(prep.ckpt, work / key, quantize=quantize, verify=trained,
                                  force=True, log=log, engine_graph=True)
        except Exception as exc:  # the rows that need it are reported as unavailable
            prep.notes.append(f"{key}: export failed: {type(exc).__name__}: {exc}")
            continue
        prep.paths[key] = str(out)
    manifest = Path(prep.paths.get("artifact", "")) / "manifest.json"
    if manifest.is_file():
        opt = json.loads(manifest.read_text()).get("optimization", {})
        if isinstance(opt, dict) and "decision" in opt:
            prep.notes.append(f"graph optimisation at export: {opt['decision']}")
