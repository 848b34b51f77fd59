"""MatMulNBits settings side by side: perplexity and decode-step time of one artifact's
model.onnx quantised each way (how --quantize int4's block 32, asymmetric, accuracy
level 4 was chosen; export/quantize.py).

Usage:
    python -m benchmarks.quant_blocks --artifact artifacts/smollm2-135m-instruct \
        [--max-tokens 1024] [--threads 2] [--out /tmp/quant-blocks]
    python -m benchmarks.quant_blocks --artifact artifacts/smollm2-135m-instruct \
        --gguf-ckpt checkpoints/smollm2-135m-instruct [--rounds 5] [--embedding-head]
    python -m benchmarks.quant_blocks --artifact artifacts/smollm2-135m-instruct \
        --engine fp32=artifacts/smollm2-135m-instruct --engine gguf=/tmp/smollm2-gguf

For every variant (float32, int8 block 32, int4 at blocks 16/32/64/128, symmetric or with
a zero point, accuracy level 0 = float activations or 4 = int8 activations) it writes a
quantised copy of model.onnx beside the artifact's config and tokenizer, scores
``--max-tokens`` of the stdlib corpus with export/evaluate.py (window 512, stride 256) and
times one decode step (a 64-token past) at batch 1 and 8: median of 15 runs after 3 warm-up
runs. Prints one line per variant. The LM head of an fp32 artifact is a Gemm, which the
quantiser leaves float32 here; an artifact exported with --quantize quantises it too.

With ``--gguf-ckpt`` (a checkpoint imported from GGUF, the artifact's source) it compares
the forms of --quantize gguf instead (export/gguf_blocks.py): Q4_1 kept exactly (zero point
0 plus the block minimums) or through float zero points, int8 (level 4) or float (level 0)
activations, the tied Q8_0 head as MatMulNBits or left a float32 Gemm; beside float32 and
our int8/int4. Every variant is loaded first and the decode steps alternate between them
(``--rounds`` rounds of 5 timed steps per variant and batch size, after 3 warm-up steps;
the median of all), so a busy machine slows them alike. It also prints how far each
variant's dequantised Q4_1 weights are from gguf's (0 for the exact form).
``--embedding-head`` times the tied Q8_0 embedding's forms alone instead
(:func:`embedding_and_head`), and ``--engine`` the engine.onnx decode steps of whole
artifacts (:func:`engine_steps`).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from service.contract import io_spec as io

VARIANTS: list[tuple[str, int | None, int, int, bool]] = [  # name, bits, block, level, sym
    ("fp32", None, 0, 0, True), ("int8-b32-a4", 8, 32, 4, True),
    *[(f"int4-b{b}-a{a}{'' if s else '-asym'}", 4, b, a, s)
      for b in (16, 32, 64, 128) for a in (0, 4) for s in (True, False)],
]


def step_ms(path: Path, artifact: Path, batch: int, threads: int, past: int = 64) -> float:
    from service.contract import io_spec as io
    from service.contract.sessions import create_session

    session = create_session(path, threads=threads)
    cfg = io.ArtifactConfig.load(artifact)
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {io.INPUT_IDS: np.full((batch, 1), 100, np.int64),
            io.ATTENTION_MASK: np.ones((batch, past + 1), np.int64),
            io.POSITION_IDS: np.full((batch, 1), past, np.int64)}
    for name in io.past_names(cfg.n_layers):  # (B, nkv, past, hs)
        feed[name] = rng.standard_normal((batch, cfg.kv_heads, past, cfg.head_dim),
                                         dtype=np.float32)
    times = []
    for i in range(18):
        started = time.perf_counter()
        session.run([io.LOGITS], feed)
        if i >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def write_variant(artifact: Path, out: Path, bits: int | None, block: int, level: int,
                  symmetric: bool) -> None:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(artifact / name, out / name)
    model = onnx.load(str(artifact / "model.onnx"))  # external weights read in
    if bits is not None:
        quantizer = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=symmetric, accuracy_level=level, bits=bits))
        quantizer.process()
        model = quantizer.model.model
    onnx.save_model(model, str(out / "model.onnx"))


GGUF_VARIANTS: list[tuple[str, str, int, bool]] = [  # name, Q4_1 mode, level, head kept
    ("gguf-exact-a4", "exact", 4, True), ("gguf-exact-a0", "exact", 0, True),
    ("gguf-floatzp-a4", "float-zp", 4, True), ("gguf-floatzp-a0", "float-zp", 0, True),
    ("gguf-exact-a4-f32head", "exact", 4, False),
]


def write_gguf_variant(artifact: Path, ckpt: Path, out: Path, mode: str, level: int,
                       head: bool) -> dict[str, object]:
    """The artifact's model.onnx with the GGUF file's blocks (export/gguf_blocks.py)."""
    import dataclasses

    import onnx

    from export.gguf_blocks import rewrite_file
    from export.gguf_source import open_source
    from model.checkpoint import read_meta

    src = open_source(read_meta(ckpt).training)
    if not head:
        src = dataclasses.replace(src, weights={k: v for k, v in src.weights.items()
                                                if k not in ("tok_emb", "lm_head.weight")})
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(artifact / name, out / name)
    model, figures = rewrite_file(artifact / "model.onnx", src, mode, level)
    onnx.save_model(model, str(out / "model.onnx"))
    return figures


def q4_1_weight_error(ckpt: Path, mode: str) -> float:
    """Largest |ORT's dequantised weight − gguf's| over the file's first Q4_1 tensor, run
    through a one-node MatMulNBits at level 0 on an identity input."""
    import gguf
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from export.gguf_blocks import BlockWriter, read_blocks
    from export.gguf_source import open_source
    from model.checkpoint import read_meta

    src = open_source(read_meta(ckpt).training)
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    tensor = next(t for t in src.tensors.values() if t.tensor_type == q4_1)
    blocks = read_blocks(tensor)
    n, k = blocks.scales.shape[0], blocks.scales.shape[1] * 32
    writer = BlockWriter(mode, 0)
    writer.matmul("x", "y", blocks, "w", "w")
    graph = helper.make_graph(writer.nodes, "one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
                              list(writer.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = sess.run(None, {"x": np.eye(k, dtype=np.float32)})[0].T  # (N, K)
    ref = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return float(np.abs(ours - ref).max())


def gguf_main(args: argparse.Namespace) -> None:
    """The --quantize gguf forms side by side, decode steps alternating between them."""
    from export.evaluate import artifact_backend, evaluate, load_text
    from service.contract.sessions import create_session

    text, source = load_text("stdlib")
    dirs: dict[str, Path] = {}
    for name, bits, block, level, symmetric in VARIANTS:
        if name in ("fp32", "int8-b32-a4", "int4-b32-a4-asym"):
            dirs[name] = args.out / name
            write_variant(args.artifact, dirs[name], bits, block, level, symmetric)
    for name, mode, level, head in GGUF_VARIANTS:
        dirs[name] = args.out / name
        write_gguf_variant(args.artifact, args.gguf_ckpt, dirs[name], mode, level, head)
    for mode in ("exact", "float-zp"):
        print(f"Q4_1 {mode}: max |ORT weight - gguf weight| = "
              f"{q4_1_weight_error(args.gguf_ckpt, mode):.3g}", flush=True)
    ppl = {name: evaluate(artifact_backend(str(d)), text, source, max_tokens=args.max_tokens,
                          threads=args.threads)["perplexity"] for name, d in dirs.items()}
    cfg = io.ArtifactConfig.load(args.artifact)
    sessions = {name: create_session(d / "model.onnx", threads=args.threads)
                for name, d in dirs.items()}
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in dirs for b in args.batches}
    feeds = {b: _decode_feed(cfg, b) for b in args.batches}
    for session in sessions.values():
        for b in args.batches:
            for _ in range(3):
                session.run([io.LOGITS], feeds[b])
    for _ in range(args.rounds):
        for name, session in sessions.items():
            for b in args.batches:
                for _ in range(5):
                    started = time.perf_counter()
                    session.run([io.LOGITS], feeds[b])
                    times[name, b].append(time.perf_counter() - started)
    for name in dirs:
        steps = "   ".join(f"b{b} {statistics.median(times[name, b]) * 1e3:6.2f} ms"
                           for b in args.batches)
        print(f"{name:22s} perplexity {ppl[name]:8.4f}   {steps}", flush=True)
    del sessions
    for d in dirs.values():
        shutil.rmtree(d)


def embedding_and_head(ckpt: Path, threads: int, rounds: int) -> None:
    """The tied Q8_0 embedding's forms alone: the LM head as a float32 Gemm(transB) or an
    8-bit MatMulNBits over the file's blocks (level 4 or 0); the embedding as a float32
    Gather or GatherBlockQuantized over the same blocks. Exactness against gguf, then the
    median time per call at batch 1, 8 and 32 (``rounds`` × 5 calls, alternating)."""
    import gguf
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.gguf_blocks import pack, read_blocks
    from export.gguf_source import open_source
    from model.checkpoint import read_meta

    tensor = open_source(read_meta(ckpt).training).tensors["token_embd.weight"]
    blocks = read_blocks(tensor)
    if blocks.bits != 8:
        raise SystemExit("--embedding-head measures a Q8_0 token_embd.weight")
    v, nb = blocks.scales.shape
    k = nb * 32
    ref = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # (V, K)

    def session(node: onnx.NodeProto, inits: list[onnx.TensorProto], x: onnx.ValueInfoProto,
                y: list[int | None]) -> ort.InferenceSession:
        graph = helper.make_graph([node], "one", [x],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
                                  inits)
        model = helper.make_model(graph, opset_imports=[
            helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 8
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])

    f32 = numpy_helper.from_array(ref, "w")
    q, s = (numpy_helper.from_array(pack(blocks.codes, 8), "q"),
            numpy_helper.from_array(blocks.scales.reshape(-1), "s"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [None])
    heads = {"head gemm f32": session(helper.make_node("Gemm", ["x", "w"], ["y"], transB=1),
                                      [f32], x, [None, v])}
    for level in (4, 0):
        heads[f"head nbits8 a{level}"] = session(helper.make_node(
            "MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=k, N=v, bits=8,
            block_size=32, accuracy_level=level), [q, s], x, [None, v])
    embeds = {
        "embed gather f32": session(helper.make_node("Gather", ["w", "ids"], ["y"]), [f32],
                                    ids, [None, k]),
        "embed gatherblockq8": session(helper.make_node(
            "GatherBlockQuantized", ["d", "ids", "s2", "z"], ["y"], domain="com.microsoft",
            gather_axis=0, quantize_axis=1, block_size=32, bits=8),
            [numpy_helper.from_array(blocks.codes.reshape(v, k), "d"),
             numpy_helper.from_array(blocks.scales, "s2"),
             numpy_helper.from_array(np.full((v, nb), 128, np.uint8), "z")], ids, [None, k]),
    }
    rng = np.random.default_rng(0)
    probe = rng.integers(0, v, 64)
    for name, sess in embeds.items():
        print(f"{name}: exact {np.array_equal(sess.run(None, {'ids': probe})[0], ref[probe])}")
    eye = np.eye(k, dtype=np.float32)
    for name in ("head nbits8 a0",):  # float activations: the weights themselves
        print(f"{name}: exact {np.array_equal(heads[name].run(None, {'x': eye})[0], ref.T)}")
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for b in (1, 8, 32):
            feeds = {**{n: {"x": rng.standard_normal((b, k), dtype=np.float32)} for n in heads},
                     **{n: {"ids": rng.integers(0, v, b)} for n in embeds}}
            for name, sess in {**heads, **embeds}.items():
                for _ in range(5):
                    started = time.perf_counter()
                    sess.run(None, feeds[name])
                    times.setdefault((name, b), []).append(time.perf_counter() - started)
    for name in {**heads, **embeds}:
        row = "   ".join(f"b{b} {statistics.median(times[name, b]) * 1e3:8.3f} ms"
                         for b in (1, 8, 32))
        print(f"{name:22s} {row}", flush=True)


def engine_steps(artifacts: list[tuple[str, Path]], batches: list[int], threads: int,
                 rounds: int, past: int = 64, capacity: int = 256) -> None:
    """engine.onnx decode steps (the served graph: GroupQueryAttention over an in-place
    cache of ``capacity`` positions, ``past`` of them filled) of several artifacts,
    alternating between them; median ms per step at each batch size."""
    import onnxruntime as ort

    from service.contract.engine_spec import (
        ENGINE_FILE,
        LOGITS_INDEX,
        SEQLENS_K,
        TOTAL_SEQUENCE_LENGTH,
        chunk_name,
        idle_chunk_inputs,
    )
    from service.contract.sessions import create_session

    cfg = io.ArtifactConfig.load(artifacts[0][1])
    sessions = {name: create_session(d / ENGINE_FILE, threads=threads) for name, d in artifacts}
    rng = np.random.default_rng(0)

    def run(session: ort.InferenceSession, b: int, caches: list[ort.OrtValue]) -> float:
        binding = session.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, np.full((b, 1), 100, np.int64))
        binding.bind_cpu_input(io.POSITION_IDS, np.full((b, 1), past, np.int64))
        binding.bind_cpu_input(SEQLENS_K, np.full(b, past, np.int32))
        binding.bind_cpu_input(TOTAL_SEQUENCE_LENGTH, np.array([past + 1], np.int32))
        if LOGITS_INDEX in {i.name for i in session.get_inputs()}:  # older files lack it
            binding.bind_cpu_input(LOGITS_INDEX, np.zeros((b, 1), np.int64))
        for name, value in zip(io.past_names(cfg.n_layers), caches, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(io.present_names(cfg.n_layers), caches, strict=True):
            binding.bind_ortvalue_output(name, value)
        binding.bind_output(io.LOGITS, "cpu")
        idle = idle_chunk_inputs({i.name for i in session.get_inputs()}, cfg.n_layers,
                                 cfg.kv_heads, cfg.head_dim)  # a mixed graph's second group
        for name, value in idle.items():
            binding.bind_cpu_input(name, value)
        for name in (io.LOGITS, *io.present_names(cfg.n_layers)) if idle else ():
            binding.bind_output(chunk_name(name), "cpu")
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        return time.perf_counter() - started

    shape = (0, cfg.kv_heads, capacity, cfg.head_dim)  # (B, nkv, capacity, hs)
    caches = {b: [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(
        (b, *shape[1:]), dtype=np.float32)) for _ in range(2 * cfg.n_layers)] for b in batches}
    times: dict[tuple[str, int], list[float]] = {}
    for session in sessions.values():  # warm-up
        for b in batches:
            for _ in range(3):
                run(session, b, caches[b])
    for _ in range(rounds):
        for b in batches:
            for name, session in sessions.items():
                times.setdefault((name, b), []).extend(run(session, b, caches[b])
                                                       for _ in range(5))
    for name in sessions:
        row = "   ".join(f"b{b} {statistics.median(times[name, b]) * 1e3:7.2f} ms"
                         for b in batches)
        print(f"engine {name:14s} {row}", flush=True)


def _decode_feed(cfg: io.ArtifactConfig, batch: int, past: int = 64) -> dict[str, np.ndarray]:
    """One decode step's inputs: a ``past``-token random cache per row."""
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {io.INPUT_IDS: np.full((batch, 1), 100, np.int64),
            io.ATTENTION_MASK: np.ones((batch, past + 1), np.int64),
            io.POSITION_IDS: np.full((batch, 1), past, np.int64)}
    for name in io.past_names(cfg.n_layers):  # (B, nkv, past, hs)
        feed[name] = rng.standard_normal((batch, cfg.kv_heads, past, cfg.head_dim),
                                         dtype=np.float32)
    return feed


def main() -> None:
    from export.evaluate import artifact_backend, evaluate, load_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/quant-blocks"))
    parser.add_argument("--gguf-ckpt", type=Path, default=None,
                        help="compare the forms of --quantize gguf (the checkpoint imported "
                             "from the GGUF file the artifact was exported from)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=DIR",
                        help="only time engine.onnx decode steps of these artifacts "
                             "(repeatable), alternating between them")
    parser.add_argument("--embedding-head", action="store_true",
                        help="with --gguf-ckpt: only compare the Q8_0 embedding's and tied "
                             "head's forms, one operator at a time")
    args = parser.parse_args()
    for logger in ("", "onnxruntime.quantization.matmul_nbits_quantizer"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    if args.engine:
        named = [(n, Path(d)) for n, d in (e.split("=", 1) for e in args.engine)]
        engine_steps(named, args.batches, args.threads, args.rounds)
        return
    if args.gguf_ckpt is not None and args.embedding_head:
        embedding_and_head(args.gguf_ckpt, args.threads, args.rounds)
        return
    if args.gguf_ckpt is not None:
        gguf_main(args)
        return
    text, source = load_text("stdlib")
    for name, bits, block, level, symmetric in VARIANTS:
        out = args.out / name
        write_variant(args.artifact, out, bits, block, level, symmetric)
        ppl = evaluate(artifact_backend(str(out)), text, source, max_tokens=args.max_tokens,
                       threads=args.threads)["perplexity"]
        b1, b8 = (step_ms(out / "model.onnx", args.artifact, b, args.threads) for b in (1, 8))
        print(f"{name:18s} perplexity {ppl:8.4f}   step b1 {b1:6.2f} ms   b8 {b8:6.2f} ms",
              flush=True)
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
