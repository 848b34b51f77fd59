"""benchmarks/lib/gguf_export.py: a GGUF rewritten as f32 keeps its metadata and holds exactly
the values the blocks encode, checked against the block formulas worked out in numpy
(Q8_0: d·q; Q4_1: d·q + m), not against the dequantiser it calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.lib.gguf_export import dequantize_gguf


def q8_0_blocks(rows: int, blocks: int, rng: np.random.Generator) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Raw Q8_0 bytes (rows, blocks × 34) and the values they encode (rows, blocks × 32)."""
    d = rng.uniform(0.01, 0.1, (rows, blocks)).astype(np.float16)
    q = rng.integers(-128, 128, (rows, blocks, 32), dtype=np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8).reshape(rows, blocks, 2),
                          q.view(np.uint8)], axis=2).reshape(rows, blocks * 34)
    values = d.astype(np.float32)[..., None] * q.astype(np.float32)  # (rows, blocks, 32)
    return raw, values.reshape(rows, blocks * 32)


def q4_1_blocks(rows: int, blocks: int, rng: np.random.Generator) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Raw Q4_1 bytes (rows, blocks × 20) and their values: d·q + m, q in 0..15, weights
    j and j + 16 of a block share byte j (low nibble first)."""
    d = rng.uniform(0.01, 0.1, (rows, blocks)).astype(np.float16)
    m = rng.uniform(-0.5, 0.0, (rows, blocks)).astype(np.float16)
    q = rng.integers(0, 16, (rows, blocks, 32), dtype=np.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # (rows, blocks, 16)
    raw = np.concatenate([d[..., None].view(np.uint8).reshape(rows, blocks, 2),
                          m[..., None].view(np.uint8).reshape(rows, blocks, 2), packed],
                         axis=2).reshape(rows, blocks * 20)
    values = (d.astype(np.float32)[..., None] * q.astype(np.float32)
              + m.astype(np.float32)[..., None])
    return raw, values.reshape(rows, blocks * 32)


def test_f32_copy_keeps_metadata_and_the_blocks_values(tmp_path: Path) -> None:
    import gguf

    rng = np.random.default_rng(0)
    src, dst = tmp_path / "m.gguf", tmp_path / "m-f32.gguf"
    emb_raw, emb = q8_0_blocks(6, 2, rng)
    mat_raw, mat = q4_1_blocks(4, 2, rng)
    norm = rng.standard_normal(64).astype(np.float32)
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_tensor("token_embd.weight", emb_raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", mat_raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    info = dequantize_gguf(src, dst)

    assert info["source_tensor_types"] == {"Q8_0": 1, "Q4_1": 1, "F32": 1}
    out = gguf.GGUFReader(str(dst))
    assert out.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    assert out.fields["general.architecture"].contents() == "llama"
    assert out.fields["llama.block_count"].contents() == 1
    assert out.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert out.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    tensors = {t.name: t for t in out.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    np.testing.assert_array_equal(tensors["token_embd.weight"].data, emb)  # (6, 64)
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"].data, mat)  # (4, 64)
    np.testing.assert_array_equal(tensors["blk.0.attn_norm.weight"].data, norm)
    assert not list(tmp_path.glob(".*tmp*"))  # written to a temporary name, then renamed
