"""A rewrite lets go of the GGUF file's pages each product's rows were read from
(export/gguf/blocks.py ``Piece.release_pages``): the memory map would otherwise hold the
whole file resident by the last product."""

from __future__ import annotations

import mmap
from pathlib import Path

import gguf
import numpy as np

from export.gguf.blocks import Piece
from export.gguf.source import Part
from service.contract.pages import file_mappings

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def resident(path: Path) -> int:
    return sum(m.resident_bytes for m in file_mappings(path))


def test_a_piece_drops_the_pages_of_its_rows_and_reads_them_back(tmp_path: Path) -> None:
    weight = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, Q8_0)  # (512, 1088) uint8: 136 pages
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(path).tensors[0]
    piece = Piece(0, 512, (int(Q8_0),), True, ((Part(tensor.name, np.arange(512)), tensor),))

    assert np.array_equal(piece.stored, blocks)  # every row read
    before = resident(path)
    assert before >= blocks.nbytes

    piece.release_pages()

    # what stays: the header's pages and the two the tensor shares with its neighbours
    assert resident(path) <= before - blocks.nbytes + 2 * mmap.PAGESIZE
    assert np.array_equal(piece.stored, blocks)  # read back from the file
    assert np.array_equal(gguf.quants.dequantize(piece.stored, Q8_0),
                          gguf.quants.dequantize(blocks, Q8_0))
