"""Checkpoint directory → verified artifact directory (the whole export pipeline).

    model.onnx       decoder with KV cache, the I/O contract graph (export/onnx/model_graphs.py)
    attention.onnx   attention introspection graph
    engine.onnx      with --engine-graph: the service's decoder (export/onnx/engine_graph.py)
    engine_mixed.onnx  the same with a second group of rows (mixed steps), unless
                     --no-mixed-steps
    *_lora.onnx      engine.onnx, engine_mixed.onnx and attention.onnx with LoRA adapters
                     per row (export/lora/adapter_graph.py; not for a float16 artifact)
    weights.bin      every graph's weights, each distinct tensor once (export/onnx/onnx_build.py)
    tokenizer.json   copied from the checkpoint
    chat_template.jinja, tokenizer_config.json, generation_config.json
                     copied from the checkpoint when it has them (the chat template)
    config.json      io_spec.ArtifactConfig: what the service needs to know
    manifest.json    sha256 + size of each file, provenance, I/O shapes, verification figures

Everything is built in a temporary sibling directory and renamed onto the target only
after verification passed, so a failed or interrupted export leaves nothing behind.

Memory: each graph's weights go to weights.bin as the graph is built; PyTorch answers
every parity check first (TorchReference.prepare) and its weights are dropped before any
ONNX Runtime session opens; then one session at a time. SmolLM2-135M's `--quantize gguf
--engine-graph` export peaked at 15.3 GB before and 1.4 GB after (docs/export.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from model.staging import staged_directory
from service.contract import io_spec as io
from service.contract.graphs import FLOAT32_PASS_TOKENS, GraphTable
from service.contract.manifest import Manifest, checkpoint_fingerprint, describe_files
from service.contract.sessions import uses_gguf_ops

DTYPES = ("float32", "float16")
QUANTIZATIONS = ("int8", "int4", "int8-dynamic", "gguf")  # export/quantize/weights.py METHODS
ENGINE_QUANTIZATIONS = (None, "int8", "int4", "gguf")  # MatMulNBits: what engine.onnx can take
ATTENTION_QUANTIZATIONS = ("int8", "int4", "gguf")  # attention.onnx then reads them too


def _versions() -> dict[str, str]:
    out = {}
    for package in ("attnserve", "torch", "onnx", "onnxruntime", "numpy", "gguf"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "unknown"
    return out


def check_target(out: Path, force: bool) -> None:
    """Refuse to overwrite a non-empty directory (or any file) unless ``force``."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"output directory {out} is not empty (use --force to replace it)")


def check_options(opset: int, dtype: str, quantize: str | None) -> None:
    from export.onnx.model_graphs import SUPPORTED_OPSETS

    if opset not in SUPPORTED_OPSETS:
        raise ValueError(f"unsupported opset {opset}; choose one of {list(SUPPORTED_OPSETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantize!r}; choose one of "
                         f"{list(QUANTIZATIONS)}")
    if quantize is not None and dtype != "float32":
        raise ValueError(f"--quantize {quantize} needs --dtype float32 "
                         "(quantised weights, float32 cache)")


def check_kernel(kernel: str, quantize: str | None) -> None:
    """``--kernel``: ggml's computes a GGUF file's blocks as stored (--quantize gguf, at int8
    or float activations) and needs the op library built here; one line where it cannot
    be used."""
    from export.gguf.blocks import KERNELS
    from service import ops

    if kernel not in KERNELS:
        raise ValueError(f"unsupported kernel {kernel!r}; choose one of {list(KERNELS)}")
    if kernel == "nbits":
        return
    if quantize != "gguf":
        raise ValueError("--kernel ggml computes a GGUF file's own blocks: it needs "
                         "--quantize gguf")
    if ops.library_path() is None:
        raise ValueError("--kernel ggml: the GgufMatMul op library is not built here; run "
                         "`make gguf-ops` (or export with --kernel nbits)")


def check_kv_dtype(kv_dtype: io.KvDtype | None, dtype: str, engine_graph: bool, kernel: str,
                   level: int, from_blocks: bool) -> io.KvDtype | None:
    """``--kv-dtype``: None where the engine graphs' cache is ``dtype``'s, "float16" for the
    GGUF ops' CPU graphs' float16 cache (export/gguf/half_cache.py: only what those graphs'
    export writes, at int8 activations, where the served graph is judged against the float32
    cache's), ValueError for anything else. None asks for the float16 cache wherever it can
    be written (as llama.cpp keeps its cache), else ``dtype``'s."""
    can = dtype == "float32" and engine_graph and kernel == "ggml" and level != 0 and from_blocks
    if kv_dtype is None:
        return "float16" if can else None
    if kv_dtype == dtype:
        return None
    if kv_dtype not in DTYPES:
        raise ValueError(f"unsupported kv_dtype {kv_dtype!r}; choose one of {list(DTYPES)}")
    if dtype == "float16":
        raise ValueError("--dtype float16 keeps its KV cache in float16 (--kv-dtype float32 "
                         "is not offered with it)")
    if not can:
        raise ValueError("--kv-dtype float16 (with float32 weights) needs --engine-graph "
                         "--quantize gguf --kernel ggml at int8 activations, from a "
                         "checkpoint holding its GGUF file, every matrix of a kept type, "
                         "and no --float32-twin")
    return kv_dtype


def load_source(ckpt_dir: Path, leave: frozenset[Any] = frozenset()) -> tuple[Any, Any]:
    """Load the checkpoint and check its tokenizer against the model; (Checkpoint, Tokenizer).
    ``leave``: the GGUF types whose weights stay on the meta device (load_checkpoint)."""
    from tokenizers import Tokenizer

    from model.checkpoint import CheckpointError, descends_from_import, load_checkpoint
    from model.tokenizer import checkpoint_special_ids

    ckpt = load_checkpoint(ckpt_dir, leave=leave)
    try:
        tok = Tokenizer.from_file(str(ckpt.tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise CheckpointError(f"{ckpt.tokenizer_path} is not a valid tokenizer: {exc}") from exc
    vocab = ckpt.meta.model.vocab_size
    # A trained checkpoint's vocab_size is its tokenizer's size, so any difference means the
    # wrong tokenizer.json; an imported model may have more embedding rows than tokens
    # (vocabularies padded for speed), never fewer.
    size, imported = tok.get_vocab_size(), descends_from_import(ckpt.meta.training)
    if size > vocab or (size < vocab and not imported):
        raise CheckpointError(
            f"tokenizer {ckpt.tokenizer_path} has {tok.get_vocab_size()} tokens but the model's "
            f"vocab_size is {vocab}")
    try:
        checkpoint_special_ids(tok, ckpt.meta.tokenizer)
    except ValueError as exc:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: special token ids: {exc}") from exc
    return ckpt, tok


def artifact_config(ckpt: Any, model_name: str, kv_dtype: io.KvDtype,
                    tok: Any) -> io.ArtifactConfig:
    from model.tokenizer import checkpoint_special_ids

    cfg = ckpt.meta.model
    ids = checkpoint_special_ids(tok, ckpt.meta.tokenizer)
    return io.ArtifactConfig(
        model_name=model_name, vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        n_heads=cfg.n_heads, n_layers=cfg.n_layers, max_seq_len=cfg.max_seq_len,
        pad_token_id=ids.pad_token_id, bos_token_id=ids.bos_token_id,
        eos_token_id=ids.eos_token_id, tokenizer_kind=str(ckpt.meta.tokenizer.get("kind", "bpe")),
        kv_dtype=kv_dtype,
        generation=io.GenerationDefaults(max_new_tokens=min(64, cfg.max_seq_len // 2)),
        arch=cfg.arch, n_kv_heads=cfg.n_kv_heads if cfg.kv_heads != cfg.n_heads else None,
        head_size=cfg.head_size,
    )


def _aside(path: Path) -> Path:
    """``path`` renamed to a hidden float32 copy beside it, which its quantised version
    replaces; the copy's path."""
    fp32 = path.with_name(f".{path.name}.fp32")
    os.replace(path, fp32)
    return fp32


def _quantize_attention(gpt: Any, fp32_path: Path, out: Path, training: dict[str, Any],
                        method: str, reference: Any, fallback: dict[str, Any] | None,
                        served_level: int, kernel: str) -> dict[str, Any]:
    """attention.onnx over the weights the engine serves, at float activations. Kept GGUF
    blocks are the checkpoint's own weights exactly, so that graph is verified against
    PyTorch by the float32 rule (parity.py); re-rounded ones (int4, int8, a GGUF weight
    that fell back) have their distance reported. Its weights are stored as the served
    graphs' (8-bit blocks split in two only where those run at float activations), so
    weights.bin holds them once."""
    from export.gguf.blocks import repacks
    from export.quantize.weights import ATTENTION_ACCURACY_LEVEL, quantize_weights
    from export.verify.parity import check_attention, check_prompts, verify_attention

    figures = quantize_weights(fp32_path, out, method, training,
                               level=ATTENTION_ACCURACY_LEVEL, halves=served_level == 0,
                               kernel=kernel, repack=repacks(kernel, served_level))
    if reference is None:  # --no-verify
        return figures
    if method == "gguf" and not fallback:
        return {**figures, "verified": True,
                **verify_attention(gpt, out, reference=reference)}
    prompts = check_prompts(gpt.config).attention
    return {**figures, "verified": False, **check_attention(gpt, out, prompts, reference)}


def export_artifact(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    opset: int | None = None,
    dtype: io.KvDtype = "float32",
    quantize: str | None = None,
    verify: bool = True,
    force: bool = False,
    model_name: str | None = None,
    log: Any = None,
    engine_graph: bool = False,
    mixed_steps: bool = True,
    float32_twin: bool = False,
    activations: str = "int8",
    kernel: str = "nbits",
    kv_dtype: io.KvDtype | None = None,
) -> Path:
    """Build, verify and (optionally) quantise; return the artifact directory.

    ``engine_graph`` also writes engine.onnx, the service-only decoder with an in-place
    KV cache (export/onnx/engine_graph.py), and unless ``mixed_steps`` is off engine_mixed.onnx,
    the same decoder with a second group of rows for newcomers' prompts and prompt chunks
    (the server runs one or the other); model.onnx is unchanged either way. With
    ``quantize="int8"`` or ``"int4"`` both graphs get MatMulNBits weights
    (export/quantize/weights.py), and so does attention.onnx, which then reads the weights the
    engine serves (at float activations: introspection, not speed). All graphs point into
    one weights.bin, each distinct tensor stored once: a --quantize gguf artifact holds
    the file's blocks and little else.

    ``float32_twin`` (opt-in: it costs the float32 weights' bytes, which the export
    reports) adds engine_float32.onnx, a quantised engine graph's float32 weights for
    long passes. The manifest's ``graphs`` says which graph runs which pass
    (service/contract/graphs.py). ``activations="float"`` (--quantize gguf) runs the
    kept blocks at float activations rather than int8 ones (docs/export.md: slower, and
    the answers of the float32 model). ``kernel="ggml"`` (--quantize gguf): the kept
    blocks as the file stores them, computed by ggml's kernels inside ONNX Runtime
    (GgufMatMul, service/ops; export/gguf/blocks.py), the weights the file's size.
    ``kv_dtype``: the engine graphs' KV cache; "float16" with a float32 ``dtype`` is the GGUF
    ops' CPU graphs' float16 cache (export/gguf/half_cache.py); None (the default): that
    where the export can write it, else ``dtype``'s.
    """
    # Everything heavy is imported before the staging directory exists, so a SIGTERM
    # never lands inside an extension module's initialisation.
    from export.from_blocks import builds_from_blocks, export_from_blocks
    from export.lora.adapter_check import (
        AdapterReference,
        verify_adapter_graphs,
        write_served_adapter_graphs,
    )
    from export.memory import release
    from export.onnx.engine_graph import build_engine_graph
    from export.onnx.float16 import halve_artifact
    from export.onnx.model_graphs import DEFAULT_OPSET, build_graphs
    from export.onnx.onnx_build import WeightsWriter, load_graph
    from export.quantize.weights import (
        ACTIVATION_LEVELS,
        SIDE_DATA,
        gguf_advice,
        quantize_graph,
    )
    from export.verify.engine_parity import EngineDecoder, verify_engines
    from export.verify.parity import (
        TorchReference,
        check_prompts,
        decoder_for,
        described,
        verify_artifact,
    )
    from model.gguf.codes import DIRECT
    from service.contract.engine_spec import (
        ENGINE_FILE,
        ENGINE_FLOAT32_FILE,
        ENGINE_MIXED_FILE,
    )

    say = log or (lambda _msg: None)
    opset = DEFAULT_OPSET if opset is None else opset
    out = Path(out_dir)
    check_options(opset, dtype, quantize)
    if engine_graph and quantize not in ENGINE_QUANTIZATIONS:
        raise ValueError("--engine-graph needs float32 or float16 weights or --quantize "
                         "int8/int4/gguf (no --quantize int8-dynamic)")
    if engine_graph:
        from model.checkpoint import read_meta

        head_dim = read_meta(ckpt_dir).model.head_dim
        if head_dim % 8:
            raise ValueError(f"--engine-graph needs a head size that is a multiple of 8 "
                             f"(ONNX Runtime's GroupQueryAttention); this model's is {head_dim}")
    if activations not in ACTIVATION_LEVELS:
        raise ValueError(f"unsupported activations {activations!r}; choose one of "
                         f"{list(ACTIVATION_LEVELS)}")
    if activations != "int8" and quantize != "gguf":
        raise ValueError("--activations float needs --quantize gguf (the kept blocks; "
                         "int4/int8 are requantised for int8 activations)")
    level = ACTIVATION_LEVELS[activations]
    check_kernel(kernel, quantize)
    check_target(out, force)
    from_blocks = builds_from_blocks(Path(ckpt_dir), quantize, float32_twin)
    engine_kv_dtype = check_kv_dtype(kv_dtype, dtype, engine_graph, kernel, level, from_blocks)
    # built from the blocks: the kept types' matrices stay on the meta device
    ckpt, tok = load_source(Path(ckpt_dir), leave=frozenset(DIRECT) if from_blocks else frozenset())
    if quantize == "gguf":  # refuse before writing anything: no source file, or another one
        from export.gguf.source import open_source

        open_source(ckpt.meta.training, ckpt.held.reader if from_blocks else None)
    model_cfg = ckpt.meta.model
    if engine_graph and model_cfg.position == "rope" and (
            model_cfg.head_dim % 16 or model_cfg.rotary_dims % 16):
        raise ValueError(f"--engine-graph needs a head_dim (and rotary dimensions) that are "
                         f"multiples of 16 for GroupQueryAttention's rotary kernel; this "
                         f"model's are {model_cfg.head_dim} ({model_cfg.rotary_dims}): export "
                         "without it (the service then decodes with model.onnx)")
    gpt = ckpt.model.eval()
    # a quantised engine graph may also get its float32 build, for long passes
    float32_pass_tokens = FLOAT32_PASS_TOKENS.get(str(quantize), 0)
    twin = engine_graph and float32_pass_tokens > 0 and float32_twin
    with staged_directory(out) as tmp:
        if from_blocks:
            done = export_from_blocks(ckpt, tok, tmp, opset=opset, engine_graph=engine_graph,
                                      mixed_steps=mixed_steps, level=level,
                                      verify=verify, say=say, kernel=kernel,
                                      kv_dtype=engine_kv_dtype)
            _write_rest(tmp, ckpt, tok, Path(ckpt_dir), out, model_name, dtype, opset, quantize,
                        engine_graph, mixed_steps, float32_pass_tokens, say, **done,
                        engine_kv_dtype=engine_kv_dtype)
            return out
        started = time.perf_counter()
        model_path, attention_path = tmp / io.MODEL_FILE, tmp / io.ATTENTION_FILE
        engine_path, mixed_path = tmp / ENGINE_FILE, tmp / ENGINE_MIXED_FILE
        with WeightsWriter(tmp) as weights:
            build_graphs(gpt, weights, opset, dtype, bool(quantize), engine_graph, mixed_steps)
            if twin:  # float32, for wide passes: its LM head the embedding's bytes (built
                # now, while PyTorch's weights are here; its tensors are the graphs' above)
                weights.add(ENGINE_FLOAT32_FILE, build_engine_graph(gpt, mixed=mixed_steps,
                                                                    weights=weights))
        storage = weights.figures
        build_seconds = time.perf_counter() - started
        say(f"built {', '.join(sorted(p.name for p in tmp.glob('*.onnx')))} in "
            f"{build_seconds:.1f}s")
        verification: dict[str, Any] = {"skipped": True}
        reference = adapter_reference = None
        if verify:  # PyTorch's side of every check, computed once, while its weights are here
            reference = TorchReference(gpt).prepare(check_prompts(gpt.config))
            adapter_reference = AdapterReference.of(gpt)
        # Every check compares graphs with PyTorch's figures kept above or with each other:
        # the weights can go before any session comes (a float32 one holds them again).
        gpt.to_empty(device="meta")
        release()
        if dtype == "float16" and engine_graph:  # the served graphs wholly in float16
            storage = halve_artifact(tmp, [p.name for p in (engine_path, mixed_path)
                                           if p.is_file()], say)
        if verify:
            verification = verify_artifact(gpt, model_path, attention_path, dtype,
                                           reference=reference)
            say(described(verification))
            verify_engines(gpt, {key: path for key, path in (("engine", engine_path),
                                                             ("engine_mixed", mixed_path))
                                 if path.is_file()}, verification, reference, say, dtype)
            assert adapter_reference is not None
            verification["adapters"] = verify_adapter_graphs(tmp, gpt.config,
                                                             adapter_reference)
            say(f"verified the adapter graphs against PyTorch: {_adapter_figures(verification)}")
        if quantize is not None:
            if (advice := gguf_advice(ckpt.meta.training, quantize)) is not None:
                say(advice)
            quantization = quantize_graph(
                gpt, _aside(model_path), model_path, tok, ckpt.meta.training, quantize, level,
                kernel, decoder=(lambda p: decoder_for(p, gpt, "float32")) if verify else None)
            say(f"{quantize}: token agreement {quantization.get('token_agreement')}, "
                f"perplexity change {quantization.get('perplexity_relative_change')}")
            kept_types = ", ".join(sorted(t.name for t in DIRECT))
            for node, f in (quantization.get("fallback") or {}).items():
                tensors = ", ".join(f"{t} ({k})" for t, k in zip(f["tensors"], f["types"],
                                                               strict=True))
                say(f"{node}: {tensors} not kept as the file's blocks (--quantize gguf keeps "
                    f"{kept_types}): {f.get('as')} instead")
            verification["quantized"] = quantization
            if quantize in ATTENTION_QUANTIZATIONS:
                verification["attention_quantized"] = _quantize_attention(
                    gpt, _aside(attention_path), attention_path, ckpt.meta.training, quantize,
                    reference, quantization.get("fallback"), level, kernel)
                if verify:
                    say(f"{quantize} attention.onnx: attention weights "
                        f"{verification['attention_quantized']['weights_max_abs_diff']:.2e} "
                        "from PyTorch's")
            # judged on engine.onnx: engine_mixed.onnx's is the same rewrite
            for key, path, judged in (("engine_quantized", engine_path, verify),
                                      ("engine_mixed_quantized", mixed_path, False)):
                if path.is_file():
                    verification[key] = quantize_graph(
                        gpt, _aside(path), path, tok, ckpt.meta.training, quantize, level,
                        kernel, flat=True,
                        decoder=(lambda p: EngineDecoder(p, gpt)) if judged else None)
            if engine_graph:
                say(f"{quantize} engine.onnx: token agreement "
                    f"{verification['engine_quantized'].get('token_agreement')}")
            # one weights.bin again, each graph loaded and stored in turn, in the order
            # they always had; the graphs as quantised stay on disk, with the old
            # weights.bin, until the block ends
            with WeightsWriter(tmp, base=tmp) as weights:
                for path in sorted(tmp.glob("*.onnx")):
                    if path.name != ENGINE_FLOAT32_FILE:
                        weights.add(path.name, load_graph(path))
                if twin:
                    weights.add(ENGINE_FLOAT32_FILE, load_graph(tmp / ENGINE_FLOAT32_FILE))
            storage = weights.figures
            if twin:  # what the float32 weights cost on disk (bytes nobody else reads)
                storage["opt_in_bytes"] = {ENGINE_FLOAT32_FILE:
                                           weights.added.get(ENGINE_FLOAT32_FILE, 0)}
                say(f"{ENGINE_FLOAT32_FILE} +"
                    f"{storage['opt_in_bytes'][ENGINE_FLOAT32_FILE] / 1e6:.1f} MB")
            if twin and verify:
                verify_engines(gpt, {"engine_float32": tmp / ENGINE_FLOAT32_FILE}, verification,
                               reference, say)
            for stale in [*tmp.glob(".*.fp32"), *tmp.glob(f"*.onnx{SIDE_DATA}")]:
                stale.unlink()  # the float32 graphs, and quantised weights now in weights.bin
        # the served graphs are final: their adapter graphs, over the same weights.bin
        # (checked against PyTorch above; a quantised one's base rows checked here)
        served = write_served_adapter_graphs(tmp, gpt.config, verify and quantize is not None,
                                             say)
        if verify:
            verification["adapters_served"] = served
        _write_rest(tmp, ckpt, tok, Path(ckpt_dir), out, model_name, dtype, opset, quantize,
                    engine_graph, mixed_steps, float32_pass_tokens, say, storage=storage,
                    build_seconds=build_seconds, verification=verification)
    return out


def _adapter_figures(verification: dict[str, Any]) -> str:
    """The adapter graphs' check in a line: each graph's largest difference from PyTorch."""
    figures = verification["adapters"]
    if "skipped" in figures:
        return f"none ({figures['skipped']})"
    return ", ".join(f"{name} {f.get('max_abs_diff', f.get('weights_max_abs_diff')):.2e}"
                     for name, f in figures.items())


def _write_rest(tmp: Path, ckpt: Any, tok: Any, ckpt_dir: Path, out: Path,
                model_name: str | None, dtype: io.KvDtype, opset: int, quantize: str | None,
                engine_graph: bool, mixed_steps: bool, float32_pass_tokens: int,
                say: Any, *, storage: dict[str, Any], build_seconds: float,
                verification: dict[str, Any], engine_kv_dtype: io.KvDtype | None = None
                ) -> None:
    """The tokenizer and chat files, config.json and manifest.json beside the graphs,
    with the table of which graph runs which pass (``float32_pass_tokens``: from how many
    tokens engine_float32.onnx runs, where the artifact has it; ``engine_kv_dtype``: the
    steps graphs' cache where it is not ``dtype``'s)."""
    from export.onnx.model_graphs import attention_io_shapes, grouped_kv
    from export.onnx.onnx_build import WEIGHTS_FILE

    shutil.copyfile(ckpt.tokenizer_path, tmp / io.TOKENIZER_FILE)
    for name in io.OPTIONAL_HF_FILES:  # chat template and friends, when the checkpoint has them
        if (Path(ckpt_dir) / name).is_file():
            shutil.copyfile(Path(ckpt_dir) / name, tmp / name)
    config = artifact_config(ckpt, model_name or out.name, dtype, tok)
    (tmp / io.CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n", "utf-8")
    files = describe_files(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()))
    parameter_bytes = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    storage.update(artifact_bytes=sum(e.size for e in files.values()),
                   parameter_bytes=parameter_bytes)
    say(f"artifact {storage['artifact_bytes'] / 1e6:.1f} MB for "
        f"{parameter_bytes / 1e6:.1f} MB of weights ({WEIGHTS_FILE}: "
        f"{storage['weights_bytes'] / 1e6:.1f} MB, shared by every graph)")
    source = ckpt.meta.training.get("imported_from")
    if quantize == "gguf" and isinstance(source, dict) and source.get("size"):
        storage["source_bytes"] = int(source["size"])
        say(f"{WEIGHTS_FILE} is {storage['weights_bytes'] / storage['source_bytes']:.2f}× "
            f"the GGUF file ({storage['source_bytes'] / 1e6:.1f} MB)")
    manifest = Manifest(
        files=files,
        source_checkpoint=checkpoint_fingerprint(ckpt_dir),
        exporter={"name": "attnserve graph builder", "method": "direct (export/onnx/"
                  "model_graphs.py, export/onnx/engine_graph.py)",
                  "build_seconds": round(build_seconds, 3),
                  **({"engine_mixed_steps": mixed_steps} if engine_graph else {}),
                  "storage": storage, "versions": _versions()},
        opset=opset, kv_dtype=dtype, quantization=quantize,
        io={"model": io.model_io_shapes(ckpt.meta.model.n_layers,
                                        grouped_kv(ckpt.meta.model)),
            "attention": attention_io_shapes(ckpt.meta.model.n_layers),
            "logits_dtype": "float32", "kv_dtype": dtype},
        verification=verification,
        optimization={"offline": False, "note": "ONNX Runtime optimises each graph when "
                      "a session loads it; an optimised copy would store the weights again"},
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        graphs=GraphTable.of_files(files, dtype, float32_pass_tokens,
                                   2 if mixed_steps else 1,
                                   ggml=[name for name in files if name.endswith(".onnx")
                                         and uses_gguf_ops(tmp / name)],
                                   engine_kv_dtype=engine_kv_dtype).to_list(),
    )
    manifest.write(tmp)
