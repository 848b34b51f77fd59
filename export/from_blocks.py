"""``--quantize gguf`` of a checkpoint that holds its GGUF file, built from the blocks.

The general export (export/to_onnx.py) builds float32 graphs from the PyTorch model,
verifies them against PyTorch, then swaps each weight for the file's blocks and judges
the result against the float32 graph. At 135 M that was cheap; at 1 B it held 4.3 GB of
float32 weights in PyTorch and again in each float32 ONNX Runtime session (5.6 GB peak,
about 590 s on 2 cores), and a 3B model (12 GB of float32) took 14 GB.

Here no weight matrix is ever in float32 whole:

1. The model is loaded with the matrices of kept block types left on the meta device
   (model/gguf/reader.py ``HeldWeights``); the graph builders write a placeholder for
   each (export/onnx/onnx_build.py), and export/gguf/blocks.py fills them with the file's
   blocks, tensor by tensor.
2. The graphs are verified by the float32 rule against PyTorch, as before, in the form
   whose arithmetic is float32's: the blocks at float activations (with ggml's kernels
   GgufMatMul over the file's bytes as stored; with MatMulNBits' accuracy level 0, 8-bit
   blocks as two exact 4-bit products). Blocks dequantise exactly to the
   checkpoint's weights, so these graphs compute the float32 model up to summation order.
   PyTorch's side is computed layer by layer (export/verify/layerwise.py).
3. The served graphs (int8 activations, the default) are judged against those
   float-activation graphs as a quantised graph is judged against its float32 one
   (token agreement and perplexity, export/quantize/weights.py).

4. The adapter graphs (export/lora/adapter_graph.py) are written over the final graphs; their
   base rows are checked against those graphs (there is no float32 model to merge an
   adapter into).

Used when every weight matrix of the file is of a kept type (what llama.cpp's quantiser
writes: Q4_0, Q4_K_M, Q8_0 …) and no float32 twin is asked for; otherwise the general
export runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from export.gguf.source import read_as_blocks
from model.checkpoint import GGUF_WEIGHTS_FILE, weights_path
from model.gguf.codes import DIRECT
from model.gguf.reader import open_gguf

# the copies of the graphs verified at float activations, until the export ends
CHECK_SUFFIX = ".check"
PLACEHOLDER_SUFFIX = ".placeholders"  # a graph as built, before its blocks are in


def builds_from_blocks(ckpt_dir: Path, quantize: str | None, float32_twin: bool) -> bool:
    """Whether this export takes the path of this module (see its docstring)."""
    if quantize != "gguf" or float32_twin:
        return False
    held = weights_path(ckpt_dir)
    if held.name != GGUF_WEIGHTS_FILE:
        return False
    reader = open_gguf(held)
    return all(t.tensor_type in DIRECT for t in reader.tensors if len(t.shape) > 1)


def export_from_blocks(ckpt: Any, tok: Any, tmp: Path, *, opset: int, engine_graph: bool,
                       mixed_steps: bool, level: int, verify: bool,
                       say: Callable[[str], None], kernel: str = "nbits",
                       kv_dtype: str | None = None) -> dict[str, Any]:
    """Write the served graphs and weights.bin into ``tmp``; return the manifest's
    figures: verification, storage, build_seconds. ``kernel``: whose kernels the served
    graphs and attention.onnx compute the blocks with (export/gguf/blocks.py ``KERNELS``),
    and the float-activation graphs the checks verify against PyTorch too: ggml's are
    GgufMatMul over the file's bytes, which read as mapped pages where MatMulNBits' level 0
    unpacked a converted copy into the session (the 1B Q4_K_M file's export: peak 1.53 GB
    against 2.03, 66 s against 108; docs/export.md). ``kv_dtype`` "float16": the served
    engine graphs' cache in float16 (export/gguf/half_cache.py), judged as below against
    the float-activation graphs' float32 one."""
    from export.gguf.blocks import repacks
    from export.gguf.source import GGUFFile, open_source
    from export.lora.adapter_check import write_served_adapter_graphs
    from export.memory import release
    from export.onnx.model_graphs import build_graphs
    from export.onnx.onnx_build import WeightsWriter, load_graph
    from export.quantize.weights import (
        ATTENTION_ACCURACY_LEVEL,
        SIDE_DATA,
        compare_decoders,
        quantize_weights,
        quiet_ort_logs,
    )
    from export.verify.engine_parity import EngineDecoder
    from export.verify.parity import check_threads, decoder_for
    from service.contract import io_spec as io
    from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
    from service.contract.pages import release_file_pages

    gpt, training = ckpt.model, ckpt.meta.training
    threads = check_threads(gpt)
    # what the graphs read as float32 (GPT-2's position table) is filled now
    ckpt.held.fill(gpt, "", lambda name: not read_as_blocks(name))
    started = time.perf_counter()
    graphs = [io.MODEL_FILE, *([ENGINE_FILE] if engine_graph else []),
              *([ENGINE_MIXED_FILE] if engine_graph and mixed_steps else [])]
    with WeightsWriter(tmp) as weights:  # the small tensors; placeholders for the blocks
        build_graphs(gpt, weights, opset, "float32", True, engine_graph, mixed_steps)
    built = {name: tmp / f".{name}{PLACEHOLDER_SUFFIX}" for name in (*graphs, io.ATTENTION_FILE)}
    for name, path in built.items():
        os.replace(tmp / name, path)
    check = {name: tmp / f".{name}{CHECK_SUFFIX}" for name in graphs}

    # checked once for every rewrite, through the reader the weights come from (the held
    # file, which the import record points at)
    source: GGUFFile | None = open_source(training, ckpt.held.reader)

    def blocks(jobs: dict[str, tuple[Path, int, bool, str, bool]]
               ) -> dict[str, dict[str, Any]]:
        """Each graph ``name`` → (its rewrite, accuracy level, 8-bit blocks as halves, kernel,
        repacked), rewritten on ``threads`` threads: a rewrite is numpy over one product's
        blocks at a time, mostly outside the GIL, and on one thread left the other cores
        idle."""
        assert source is not None, "the file was closed"

        def rewrite(name: str, dst: Path, at: int, halves: bool, by: str,
                    repacked: bool) -> dict[str, Any]:
            figures = quantize_weights(built[name], dst, "gguf", training, level=at,
                                       halves=halves, source=source,
                                       flat=name in (ENGINE_FILE, ENGINE_MIXED_FILE),
                                       kernel=by, repack=repacked)
            release()  # the rewrite's buffers, before the next
            return figures

        with quiet_ort_logs(), ThreadPoolExecutor(max_workers=threads) as pool:
            futures = {name: pool.submit(rewrite, name, *job) for name, job in jobs.items()}
            done = {name: future.result() for name, future in futures.items()}
        release_file_pages(ckpt.held.path)  # every block read: the file's pages can go
        return done

    # attention.onnx: the served codes at float activations (split in halves only where
    # the served graphs run at float activations too, so weights.bin holds them once);
    # the float-activation graphs: what the checks verify (and, at level 0, what is served)
    # (with ggml's kernels a float-activation graph is GgufMatMul over the file's bytes as
    # stored: the same bytes whatever the activations, nothing split in halves)
    repack = repacks(kernel, level)  # the served graphs' and attention.onnx's bytes
    rewritten = blocks({io.ATTENTION_FILE: (tmp / io.ATTENTION_FILE, ATTENTION_ACCURACY_LEVEL,
                                            level == 0 and kernel == "nbits", kernel, repack),
                        **{name: (check[name], 0, kernel == "nbits", kernel, False)
                           for name in graphs if verify or level == 0}})
    attention = rewritten.pop(io.ATTENTION_FILE)
    build_seconds = time.perf_counter() - started
    say(f"built {', '.join(sorted((*graphs, io.ATTENTION_FILE)))} from the file's blocks in "
        f"{build_seconds:.1f}s")
    verification: dict[str, Any] = {"skipped": True}
    if verify:
        verification = _verify_float_activations(ckpt, tmp, check, graphs, attention, threads,
                                                 say)
    # Judged once, on the graph the service decodes with (engine.onnx; model.onnx without
    # engine graphs): the others run the same products at the same accuracy level.
    judged = ENGINE_FILE if engine_graph else io.MODEL_FILE
    # the served graphs: the float-activation ones themselves, or the blocks at int8
    # activations judged against them (each rewrite's blocks are a side file the size of
    # the artifact until the final weights.bin: the checked copies go first, on disk)
    final = {name: check[name] if level == 0 else tmp / name for name in graphs}
    if level != 0:
        for name in graphs:
            if name != judged or not verify:
                _remove(check[name], SIDE_DATA)
        rewritten.update(blocks({name: (tmp / name, level, False, kernel, repack)
                                 for name in graphs}))
        if kv_dtype == "float16":
            from export.gguf.half_cache import halve_cache

            engines = [name for name in graphs if name != io.MODEL_FILE]
            for name in engines:
                rewritten[name]["kv_dtype"] = "float16"
                halve_cache(tmp / name)
            say(f"{', '.join(engines)}: KV cache in float16")
    # every block read: the file's memory map goes before the sessions that judge them
    source = None
    ckpt.held.close()
    release()
    keys = {io.MODEL_FILE: "quantized", ENGINE_FILE: "engine_quantized",
            ENGINE_MIXED_FILE: "engine_mixed_quantized"}
    for name in graphs:
        verification[keys[name]] = {**rewritten[name], "judged_on": judged}
    if verify and level != 0:
        def decoder(path: Path) -> Any:
            if engine_graph:
                return EngineDecoder(path, gpt, threads=threads)
            return decoder_for(path, gpt, "float32", threads)

        figures = compare_decoders(gpt, lambda: decoder(check[judged]),
                                   lambda: decoder(tmp / judged), tok, training, "gguf")
        verification[keys[judged]].update(
            figures, reference="the file's blocks at float activations")
        _remove(check[judged], SIDE_DATA)
        say(f"{judged} at int8 activations: token agreement {figures['token_agreement']}, "
            f"perplexity change {figures['perplexity_relative_change']}")
    with WeightsWriter(tmp, base=tmp) as weights:  # the final weights.bin: the blocks once
        for name in sorted([*graphs, io.ATTENTION_FILE]):
            weights.add(name, load_graph(final.get(name, tmp / name)))
    storage = weights.figures
    for stale in [*built.values(), *tmp.glob(f".*{CHECK_SUFFIX}"),
                  *tmp.glob(f".*{CHECK_SUFFIX}{SIDE_DATA}"), *tmp.glob(f"*.onnx{SIDE_DATA}")]:
        stale.unlink(missing_ok=True)
    # the served graphs are final: their adapter graphs, over the same weights.bin (no
    # float32 PyTorch model here: base rows against the base graphs, adapted rows moved)
    served = write_served_adapter_graphs(tmp, gpt.config, verify, say, threads)
    if verify:
        verification["adapters_served"] = served
    return {"verification": verification, "storage": storage, "build_seconds": build_seconds}


def _remove(graph: Path, side_data: str) -> None:
    """A graph file and its side file of weights (export/quantize/weights.py), if there."""
    graph.unlink(missing_ok=True)
    graph.with_name(graph.name + side_data).unlink(missing_ok=True)


def _verify_float_activations(ckpt: Any, tmp: Path, check: dict[str, Path], graphs: list[str],
                              attention: dict[str, Any], threads: int,
                              say: Callable[[str], None]) -> dict[str, Any]:
    """The float-activation graphs (``check``) and attention.onnx against PyTorch run
    layer by layer, by the float32 rule (export/verify/parity.py); the manifest's figures."""
    from export.memory import release
    from export.verify.engine_parity import EngineDecoder, verify_engines
    from export.verify.layerwise import LayerwiseReference
    from export.verify.parity import check_prompts, decoder_for, described, verify_artifact
    from service.contract import io_spec as io
    from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
    from service.contract.pages import release_file_pages

    gpt = ckpt.model

    def continuing() -> Any:  # the graph whose greedy choices PyTorch is fed
        if ENGINE_FILE in graphs:  # the fastest: its cache written in place
            return EngineDecoder(check[ENGINE_FILE], gpt, threads=threads)
        return decoder_for(check[io.MODEL_FILE], gpt, "float32", threads)

    reference = LayerwiseReference(gpt, ckpt.held, continuing).prepare(
        check_prompts(gpt.config))
    release()
    release_file_pages(ckpt.held.path)  # the blocks each layer was filled from
    say(f"PyTorch's logits computed layer by layer (checks on {threads} thread"
        f"{'s' if threads > 1 else ''})")
    verification = {**verify_artifact(gpt, check[io.MODEL_FILE], tmp / io.ATTENTION_FILE,
                                      reference=reference, threads=threads),
                    "reference": "PyTorch layer by layer (export/verify/layerwise.py); graphs "
                                 "checked with the file's blocks at float activations"}
    say(described(verification, " at float activations"))
    verification["attention_quantized"] = {**attention, "verified": True,
                                           **verification["attention"]}
    verify_engines(gpt, {key: check[name] for name, key in ((ENGINE_FILE, "engine"),
                                                            (ENGINE_MIXED_FILE, "engine_mixed"))
                         if name in graphs}, verification, reference, say, threads=threads)
    del reference
    release()
    return verification
