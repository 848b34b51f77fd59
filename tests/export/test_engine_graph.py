"""engine.onnx: the service-only GroupQueryAttention decoder, against PyTorch and the manifest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.onnx.engine_graph import build_engine_graph, export_engine
from export.onnx.model_graphs import build_attention, build_decoder
from export.onnx.onnx_build import WeightsWriter
from export.to_onnx import export_artifact
from export.verify.engine_parity import verify_engine
from model.checkpoint import load_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.engine_spec import (
    CHUNK_PREFIX,
    ENGINE_FILE,
    ENGINE_MIXED_FILE,
    LOGITS_INDEX,
    SEQLENS_K,
    TOTAL_SEQUENCE_LENGTH,
    chunk_name,
    idle_chunk_inputs,
)


@pytest.fixture(scope="module")
def engine_artifact(tiny_engine_artifact: Path) -> Path:
    return tiny_engine_artifact


def test_engine_graph_is_listed_in_the_manifest_with_its_sha256(engine_artifact: Path) -> None:
    manifest = json.loads((engine_artifact / io.MANIFEST_FILE).read_text("utf-8"))
    digest = hashlib.sha256((engine_artifact / ENGINE_FILE).read_bytes()).hexdigest()
    assert manifest["files"][ENGINE_FILE]["sha256"] == digest
    engine = manifest["verification"]["engine"]
    assert engine["greedy_equal"] and engine["in_place"] and engine["max_abs_diff"] <= 1e-4
    assert engine["steps"] >= 64


def test_default_export_writes_no_engine_graph(tiny_artifact: Path) -> None:
    assert not (tiny_artifact / ENGINE_FILE).exists()
    assert (tiny_artifact / io.MODEL_FILE).is_file()


def test_model_onnx_is_the_same_with_or_without_the_engine_graph(
        engine_artifact: Path, tiny_artifact: Path) -> None:
    # Same I/O contract; the engine graph is an extra file, not a replacement.
    a = onnx.load(str(engine_artifact / io.MODEL_FILE), load_external_data=False)
    b = onnx.load(str(tiny_artifact / io.MODEL_FILE), load_external_data=False)
    assert [i.name for i in a.graph.input] == [i.name for i in b.graph.input]
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]
    assert not any(n.op_type == "GroupQueryAttention" for n in a.graph.node)


def test_engine_graph_refuses_int8_dynamic(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="int8-dynamic"):
        export_artifact(tiny_checkpoint, tmp_path / "b", quantize="int8-dynamic",
                        engine_graph=True)
    assert not (tmp_path / "b").exists()


@torch.no_grad()
def test_int8_engine_graph_agrees_with_pytorch_teacher_forced(tiny_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    out = export_artifact(tiny_checkpoint, tmp_path / "int8", quantize="int8",
                          engine_graph=True)
    manifest = json.loads((out / io.MANIFEST_FILE).read_text("utf-8"))
    assert manifest["verification"]["engine_quantized"]["token_agreement"] >= 0.97
    ops = [n.op_type for n in onnx.load(str(out / ENGINE_FILE)).graph.node]
    assert "GroupQueryAttention" in ops and "MatMulNBits" in ops and "MatMul" not in ops
    # Independent check: PyTorch fp32 greedy continuations of held-out text, then one
    # engine.onnx pass over prompt + continuation (teacher forcing): int8 argmax per position.
    ckpt = load_checkpoint(tiny_checkpoint)
    gpt, cfg = ckpt.model.eval(), ckpt.model.config
    from tokenizers import Tokenizer

    from model.data import stdlib_corpus_path

    tok = Tokenizer.from_file(str(ckpt.tokenizer_path))
    text = stdlib_corpus_path().read_text("utf-8", errors="replace")
    ids = tok.encode(text[-20000:], add_special_tokens=False).ids
    prompts = torch.tensor([ids[i * 200:i * 200 + 16] for i in range(4)])  # (4, 16)
    seqs = prompts
    for _ in range(48):
        nxt = gpt(seqs).logits[:, -1].argmax(-1, keepdim=True)  # (4, 1)
        seqs = torch.cat([seqs, nxt], dim=1)  # (4, T + 1)
    expected = gpt(seqs).logits.argmax(-1)[:, 15:-1].numpy()  # (4, 48)
    b, t = seqs.shape
    zeros = np.zeros((b, cfg.n_heads, cfg.max_seq_len, cfg.head_dim), np.float32)
    sess = ort.InferenceSession(str(out / ENGINE_FILE), providers=["CPUExecutionProvider"])
    (logits,) = sess.run([io.LOGITS], {
        io.INPUT_IDS: seqs.numpy(), io.POSITION_IDS: np.tile(np.arange(t), (b, 1)),
        SEQLENS_K: np.full(b, t - 1, np.int32), TOTAL_SEQUENCE_LENGTH: np.array([t], np.int32),
        LOGITS_INDEX: np.tile(np.arange(t), (b, 1)),
        **{n: zeros for n in io.past_names(cfg.n_layers)},
        **idle_chunk_inputs({i.name for i in sess.get_inputs()}, cfg.n_layers, cfg.kv_heads,
                            cfg.head_dim)})  # the mixed graph's second group: no token
    got = logits.argmax(-1)[:, 15:-1]  # (4, 48)
    assert (got == expected).mean() >= 0.97


def test_gelu_tied_sinusoidal_model_matches_pytorch(tmp_path: Path) -> None:
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                    max_seq_len=96, position="sinusoidal", activation="gelu",
                    tie_weights=True)
    gpt = GPT(cfg).eval()
    with torch.no_grad():  # well-separated logits, so greedy choices are not near-ties
        for param in gpt.parameters():
            param.normal_(0.0, 0.3)
    result = verify_engine(gpt, export_engine(gpt, tmp_path / ENGINE_FILE), steps=70)
    assert result["greedy_equal"] and result["in_place"]
    assert float(result["max_abs_diff"]) <= 1e-4  # type: ignore[arg-type]


def test_a_tied_embedding_is_stored_once_across_all_graphs(tmp_path: Path) -> None:
    """The LM head of a tied model is the embedding's own bytes (Gemm transB), in
    model.onnx, attention.onnx and engine.onnx alike: weights.bin holds it once."""
    torch.manual_seed(4)
    cfg = GPTConfig(vocab_size=2048, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                    max_seq_len=64, tie_weights=True)
    gpt = GPT(cfg).eval()
    graphs = {"model.onnx": build_decoder(gpt), "attention.onnx": build_attention(gpt),
              ENGINE_FILE: build_engine_graph(gpt)}
    with WeightsWriter(tmp_path) as weights:
        for name, graph in graphs.items():
            weights.add(name, graph)
    embedding = gpt.tok_emb.weight.detach().numpy().tobytes()  # 512 KiB
    blob = (tmp_path / "weights.bin").read_bytes()
    assert blob.count(embedding) == 1
    params = sum(p.numel() for p in gpt.parameters()) * 4  # the tied matrix counted once
    assert 0.95 * params < len(blob) < 1.02 * params  # small norm scales stay in the graphs
    for name in graphs:  # and each graph still runs from the shared file
        ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"])


def test_prefill_of_ragged_rows_matches_each_row_alone(tiny_checkpoint: Path) -> None:
    """Right-padded rows: each row's last real logits equal PyTorch on that row alone."""
    gpt = load_checkpoint(tiny_checkpoint).model.eval()
    cfg = gpt.config
    session = ort.InferenceSession(build_engine_graph(gpt).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    lens = [9, 4, 1]
    rows = [torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            for n in lens]
    ids = np.zeros((3, 9), np.int64)
    for i, r in enumerate(rows):
        ids[i, :lens[i]] = r.numpy()
    kv = {n: np.zeros((3, cfg.n_heads, cfg.max_seq_len, cfg.head_dim), np.float32)
          for n in io.past_names(cfg.n_layers)}
    logits, *_ = session.run(None, {
        io.INPUT_IDS: ids, io.POSITION_IDS: np.tile(np.arange(9), (3, 1)),
        SEQLENS_K: np.asarray(lens, np.int32) - 1, LOGITS_INDEX: np.tile(np.arange(9), (3, 1)),
        TOTAL_SEQUENCE_LENGTH: np.array([9], np.int32), **kv})
    with torch.no_grad():
        for i, r in enumerate(rows):
            ref = gpt(r[None, :]).logits[0].numpy()  # (n, V)
            np.testing.assert_allclose(logits[i, :lens[i]], ref, atol=1e-4)


def _engine_pass(session: ort.InferenceSession, cfg: GPTConfig, ids: np.ndarray,
                 past: int, cache: list[np.ndarray],
                 index: np.ndarray | None) -> np.ndarray:
    """One engine.onnx pass of ids (B, T) after ``past`` cached tokens per row, writing
    ``cache`` in place; logits (B, K or T, V) (``index`` None: a graph without it)."""
    b, t = ids.shape
    feed = {io.INPUT_IDS: ids, io.POSITION_IDS: np.tile(np.arange(past, past + t), (b, 1)),
            SEQLENS_K: np.full(b, past + t - 1, np.int32),
            TOTAL_SEQUENCE_LENGTH: np.array([past + t], np.int32)}
    if index is not None:
        feed[LOGITS_INDEX] = index
    binding = session.io_binding()
    binding.bind_output(io.LOGITS, "cpu")  # outputs come back in binding order: logits first
    for name, value in feed.items():
        binding.bind_cpu_input(name, value)
    for past_name, present, buffer in zip(io.past_names(cfg.n_layers),
                                          io.present_names(cfg.n_layers), cache, strict=True):
        binding.bind_cpu_input(past_name, buffer)
        binding.bind_output(present, "cpu", 0, np.float32, list(buffer.shape),
                            buffer.ctypes.data)
    session.run_with_iobinding(binding)
    return np.asarray(binding.get_outputs()[0].numpy())


@torch.no_grad()
def test_logits_index_gives_the_all_positions_logits_at_those_positions(
        tiny_checkpoint: Path) -> None:
    """engine.onnx with ``logits_index`` against the graph built without it (every fed
    position's logits, as exported before) and against PyTorch, for a prefill (the last
    position, several positions, all of them), a decode step and a multi-token extend."""
    gpt = load_checkpoint(tiny_checkpoint).model.eval()
    cfg = gpt.config
    new, old = (ort.InferenceSession(build_engine_graph(gpt, logits_index=flag)
                                     .SerializeToString(), providers=["CPUExecutionProvider"])
                for flag in (True, False))
    assert LOGITS_INDEX in {i.name for i in new.get_inputs()}
    assert LOGITS_INDEX not in {i.name for i in old.get_inputs()}
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(3, cfg.vocab_size, (2, 16), generator=gen)  # (B, 16)
    ref = gpt(seqs).logits.numpy()  # (B, 16, V) PyTorch, every position
    shape = (2, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
    caches = {flag: [np.zeros(shape, np.float32) for _ in range(2 * cfg.n_layers)]
              for flag in (True, False)}
    ids = seqs.numpy()
    # prefill of 10 tokens: the old graph's every position vs the new one's chosen ones
    everything = _engine_pass(old, cfg, ids[:, :10], 0, caches[False], None)  # (B, 10, V)
    np.testing.assert_allclose(everything, ref[:, :10], atol=1e-4)
    for index in ([[9], [9]], [[3, 9, 0], [7, 7, 1]], [list(range(10))] * 2):
        chosen = np.asarray(index, np.int64)  # (B, K)
        fresh = [np.zeros(shape, np.float32) for _ in range(2 * cfg.n_layers)]
        got = _engine_pass(new, cfg, ids[:, :10], 0, fresh, chosen)  # (B, K, V)
        assert got.shape == (2, chosen.shape[1], cfg.vocab_size)
        want = np.take_along_axis(everything, chosen[:, :, None], axis=1)  # (B, K, V)
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(got, np.take_along_axis(ref, chosen[:, :, None], 1),
                                   atol=1e-4)
    _engine_pass(new, cfg, ids[:, :10], 0, caches[True], np.array([[9], [9]]))
    # decode step: position 10, index 0
    step_old = _engine_pass(old, cfg, ids[:, 10:11], 10, caches[False], None)  # (B, 1, V)
    step_new = _engine_pass(new, cfg, ids[:, 10:11], 10, caches[True],
                            np.zeros((2, 1), np.int64))
    np.testing.assert_allclose(step_new, step_old, atol=1e-5)
    np.testing.assert_allclose(step_new[:, 0], ref[:, 10], atol=1e-4)
    # extend (one row, as GroupQueryAttention takes T > 1 after a cache): 5 tokens after
    # 11 cached, the last one's logits and all of them
    row = {flag: [c[:1] for c in caches[flag]] for flag in (True, False)}  # views of row 0
    more_old = _engine_pass(old, cfg, ids[:1, 11:16], 11, row[False], None)  # (1, 5, V)
    np.testing.assert_allclose(more_old, ref[:1, 11:16], atol=1e-4)
    snapshot = [c.copy() for c in row[True]]
    last = _engine_pass(new, cfg, ids[:1, 11:16], 11, row[True], np.array([[4]]))  # (1, 1, V)
    np.testing.assert_allclose(last[:, 0], more_old[:, 4], atol=1e-5)
    every = _engine_pass(new, cfg, ids[:1, 11:16], 11, snapshot, np.arange(5)[None, :])
    np.testing.assert_allclose(every, more_old, atol=1e-5)


def _group_feed(prefix: str, cfg: GPTConfig, ids: np.ndarray, past: int,
                index: np.ndarray) -> dict[str, np.ndarray]:
    """One group's inputs of the mixed graph: ids (B, T) after ``past`` cached tokens."""
    b, t = ids.shape
    return {prefix + io.INPUT_IDS: ids,
            prefix + io.POSITION_IDS: np.tile(np.arange(past, past + t), (b, 1)),
            prefix + SEQLENS_K: np.full(b, past + t - 1, np.int32),
            prefix + TOTAL_SEQUENCE_LENGTH: np.array([past + t], np.int32),
            prefix + LOGITS_INDEX: index}


def _mixed_pass(session: ort.InferenceSession, cfg: GPTConfig, feed: dict[str, np.ndarray],
                caches: dict[str, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One pass of the mixed graph, each group's cache written in place; both logits."""
    binding = session.io_binding()
    binding.bind_output(io.LOGITS, "cpu")
    binding.bind_output(chunk_name(io.LOGITS), "cpu")
    for name, value in feed.items():
        binding.bind_cpu_input(name, value)
    for prefix, cache in caches.items():
        for past, present, buffer in zip(io.past_names(cfg.n_layers),
                                         io.present_names(cfg.n_layers), cache, strict=True):
            binding.bind_cpu_input(prefix + past, buffer)
            binding.bind_output(prefix + present, "cpu", 0, np.float32, list(buffer.shape),
                                buffer.ctypes.data)
    session.run_with_iobinding(binding)
    logits, chunk_logits = binding.get_outputs()[:2]
    return logits.numpy(), chunk_logits.numpy()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@torch.no_grad()
def test_mixed_graph_decodes_rows_and_feeds_a_chunk_in_one_pass_as_pytorch(arch: str) -> None:
    """engine_mixed.onnx: two rows decoding (group one) and a third row's prompt
    chunks after its cache (group two) in the same passes give PyTorch's logits at every
    position asked for; a pass whose second group feeds no token decodes the same, and
    every cache holds what the next pass needs (rotary positions included for Llama)."""
    torch.manual_seed(11)
    if arch == "llama":
        cfg = GPTConfig(vocab_size=101, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2,
                        d_ff=96, max_seq_len=64, position="rope", arch="llama",
                        activation="silu", layer_norm_eps=1e-6)
    else:
        cfg = GPTConfig(vocab_size=101, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                        max_seq_len=64)
    gpt = GPT(cfg).eval()
    session = ort.InferenceSession(build_engine_graph(gpt, mixed=True).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(2)
    seqs = torch.randint(3, cfg.vocab_size, (3, 30), generator=gen)  # (3, 30)
    ref = gpt(seqs).logits.numpy()  # (3, 30, V): PyTorch, every position
    ids = seqs.numpy()
    shape = (1, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
    rows = {prefix: [np.zeros((n, *shape[1:]), np.float32) for _ in range(2 * cfg.n_layers)]
            for prefix, n in (("", 2), (CHUNK_PREFIX, 1))}
    idle = {**_group_feed(CHUNK_PREFIX, cfg, np.zeros((1, 0), np.int64), 0,
                          np.zeros((1, 0), np.int64)),  # no token, no logits
            # its attention runs on one zero row at position 0, as the service feeds it
            chunk_name(SEQLENS_K): np.zeros(1, np.int32),
            chunk_name(TOTAL_SEQUENCE_LENGTH): np.ones(1, np.int32)}
    # rows 0-1: a 6-token prompt with an idle second group, then one token per pass
    first, none = _mixed_pass(session, cfg, {**_group_feed("", cfg, ids[:2, :6], 0,
                                                           np.array([[5], [5]])), **idle}, rows)
    assert none.shape == (1, 0, cfg.vocab_size)
    np.testing.assert_allclose(first[:, 0], ref[:2, 5], atol=1e-4)
    fed = 0  # row 2's prompt: chunks of 4, 7, 1 and 5 tokens, riding along
    for step, size in enumerate((4, 7, 1, 5)):
        pos = 6 + step
        decode = _group_feed("", cfg, ids[:2, pos:pos + 1], pos, np.zeros((2, 1), np.int64))
        chunk = _group_feed(CHUNK_PREFIX, cfg, ids[2:, fed:fed + size], fed,
                            np.arange(size)[None, :])  # every position of the chunk
        got, chunk_logits = _mixed_pass(session, cfg, {**decode, **chunk}, rows)
        np.testing.assert_allclose(got[:, 0], ref[:2, pos], atol=1e-4)
        np.testing.assert_allclose(chunk_logits[0], ref[2, fed:fed + size], atol=1e-4)
        fed += size
    # the idle group again: the decode rows go on from their caches
    got, _ = _mixed_pass(session, cfg, {**_group_feed("", cfg, ids[:2, 10:11], 10,
                                                      np.zeros((2, 1), np.int64)), **idle},
                         {"": rows[""], CHUNK_PREFIX: [c.copy() for c in rows[CHUNK_PREFIX]]})
    np.testing.assert_allclose(got[:, 0], ref[:2, 10], atol=1e-4)
    # the chunk row's cache goes on too: its next token as a decode row of its own
    single = ort.InferenceSession(build_engine_graph(gpt).SerializeToString(),
                                  providers=["CPUExecutionProvider"])
    nxt = _engine_pass(single, cfg, ids[2:, fed:fed + 1], fed, rows[CHUNK_PREFIX],
                       np.zeros((1, 1), np.int64))
    np.testing.assert_allclose(nxt[0, 0], ref[2, fed], atol=1e-4)


def test_engine_graph_writes_a_mixed_twin_unless_told_not_to(
        tiny_checkpoint: Path, engine_artifact: Path, tmp_path: Path) -> None:
    """`--engine-graph` writes engine.onnx (one group of rows) and engine_mixed.onnx (two,
    over the same weights.bin), both verified and in the manifest; `--no-mixed-steps`
    only the first."""
    both = engine_artifact
    one = export_artifact(tiny_checkpoint, tmp_path / "one", engine_graph=True,
                          mixed_steps=False, verify=False)
    for out, mixed in ((both, True), (one, False)):
        manifest = json.loads((out / io.MANIFEST_FILE).read_text("utf-8"))
        assert manifest["exporter"]["engine_mixed_steps"] is mixed
        assert (ENGINE_MIXED_FILE in manifest["files"]) is mixed
        assert (out / ENGINE_MIXED_FILE).is_file() is mixed
        names = {i.name for i in onnx.load(str(out / ENGINE_FILE)).graph.input}
        assert chunk_name(io.INPUT_IDS) not in names
    mixed_names = {i.name for i in onnx.load(str(both / ENGINE_MIXED_FILE)).graph.input}
    assert chunk_name(io.INPUT_IDS) in mixed_names
    manifest = json.loads((both / io.MANIFEST_FILE).read_text("utf-8"))
    assert manifest["verification"]["engine_mixed"]["greedy_equal"]
    assert manifest["verification"]["engine_mixed"]["in_place"]
