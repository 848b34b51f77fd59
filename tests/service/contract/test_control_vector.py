"""llama.cpp's control-vector GGUF file (service/contract/control_vector.py), read and written.

The reference is the layout llama.cpp's common_control_vector_load reads and its
cvector-generator writes, built here by hand with the gguf package's own writer and read
back with its own reader; llama.cpp's tools themselves are in tests/export/test_steer.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from service.contract.control_vector import (
    ControlVector,
    ControlVectorError,
    read_control_vector,
    write_control_vector,
)

REPO = Path(__file__).resolve().parents[3]
WIDTH = 16


def directions(layers: tuple[int, ...] = (1, 2, 3), width: int = WIDTH) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(width).astype(np.float32) for k in layers}


def by_hand(path: Path, tensors: dict[str, np.ndarray], arch: str = "controlvector",
            hint: str | None = "llama", count: int | None = None,
            after: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A file in llama.cpp's layout (cvector-generator's export_gguf), written with gguf's
    writer: architecture, model_hint, int32 layer_count, the tensors in the order given."""
    writer = gguf.GGUFWriter(path, arch)
    if hint is not None:
        writer.add_string(f"{arch}.model_hint", hint)
    writer.add_int32(f"{arch}.layer_count", len(tensors) if count is None else count)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    if after is not None:
        after(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_written_vector_reads_back_with_llama_cpp_s_keys(tmp_path):
    vector = ControlVector(directions(), model_hint="qwen2")
    out = write_control_vector(vector, tmp_path / "v.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.gguf"]  # no temporary left
    back = read_control_vector(out, d_model=WIDTH, n_layers=4)
    assert back.layers == (1, 2, 3) and back.model_hint == "qwen2" and back.width == WIDTH
    for k, values in vector.directions.items():
        assert back.directions[k].dtype == np.float32
        np.testing.assert_array_equal(back.directions[k], values)
    # what llama.cpp reads, through gguf's own reader
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "controlvector"
    assert reader.fields["controlvector.model_hint"].contents() == "qwen2"
    count = reader.fields["controlvector.layer_count"]
    assert count.types == [gguf.GGUFValueType.INT32] and count.contents() == 3
    assert [(t.name, t.tensor_type, [int(n) for n in t.shape]) for t in reader.tensors] == [
        (f"direction.{k}", gguf.GGMLQuantizationType.F32, [WIDTH]) for k in (1, 2, 3)]


def test_a_file_written_by_hand_in_llama_cpp_s_layout_is_read(tmp_path):
    values = directions((5, 2, 9), width=8)  # any order, gaps allowed
    path = by_hand(tmp_path / "hand.gguf", {f"direction.{k}": v for k, v in values.items()})
    vector = read_control_vector(path, d_model=8, n_layers=10)
    assert vector.layers == (2, 5, 9) and vector.model_hint == "llama"
    for k, v in values.items():
        np.testing.assert_array_equal(vector.directions[k], v)
    # repeng writes layer_count as uint32 and a file may carry no hint: still read
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(bare, "controlvector")
    writer.add_uint32("controlvector.layer_count", 1)
    writer.add_tensor("direction.1", values[2])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_control_vector(bare).model_hint == "" and read_control_vector(bare).layers == (1,)


GOOD = directions((1, 2))


@pytest.mark.parametrize(("tensors", "kwargs", "model", "message"), [
    (GOOD, {"arch": "llama"}, {}, r"general.architecture is 'llama', not 'controlvector'"),
    (GOOD, {}, {"d_model": 32}, r"direction.1 has width 16; the model's d_model is 32"),
    ({1: GOOD[1], 2: np.zeros(8, np.float32)}, {}, {}, r"direction.2 has width 8, "
                                                           r"direction.1 has 16"),
    ({"dir.1": GOOD[1]}, {}, {}, r"tensor 'dir.1' is not named direction.<layer>"),
    ({"direction.x": GOOD[1]}, {}, {}, r"'direction.x' is not named direction.<layer>"),
    ({"direction.01": GOOD[1]}, {}, {}, r"'direction.01' is not named"),
    ({"direction.0": GOOD[1]}, {}, {}, r"direction.0: layers count from 1"),
    (GOOD, {}, {"n_layers": 2}, r"direction.2 is past the model's last steerable layer 1"),
    ({1: GOOD[1].astype(np.float16)}, {}, {}, r"direction.1 is F16; llama.cpp reads F32"),
    ({1: np.zeros((2, 8), np.float32)}, {}, {}, r"direction.1 has shape \[8, 2\]; a direction"),
    ({1: np.array([0, np.nan], np.float32)}, {}, {}, r"direction.1 holds NaN or infinity"),
    ({}, {}, {}, r"holds no direction tensors"),
    (GOOD, {"count": 3}, {}, r"controlvector.layer_count is 3 but the file holds 2"),
], ids=["arch", "d_model", "widths", "prefix", "index", "leading-zero", "layer-0", "past-end",
        "f16", "2-D", "nan", "empty", "count"])
def test_bad_files_are_refused_in_one_line(tensors, kwargs, model, message, tmp_path):
    named = {k if isinstance(k, str) else f"direction.{k}": v for k, v in tensors.items()}
    path = by_hand(tmp_path / "bad.gguf", named, **kwargs)
    with pytest.raises(ControlVectorError, match=message) as caught:
        read_control_vector(path, **model)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ControlVectorError, match="is not a readable GGUF file"):
        read_control_vector(path)


def test_a_bad_vector_or_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    with pytest.raises(ControlVectorError, match=r"direction\.0: layers count from 1"):
        ControlVector({0: GOOD[1]})
    with pytest.raises(ControlVectorError, match=r"ends in \.gguf"):
        write_control_vector(ControlVector(GOOD), tmp_path / "v.bin")

    def broken(self: gguf.GGUFWriter, *args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError, match="disk full"):
        write_control_vector(ControlVector(GOOD), tmp_path / "v.gguf")
    assert list(tmp_path.iterdir()) == []


def test_the_reader_needs_no_torch(tmp_path):
    path = write_control_vector(ControlVector(GOOD, "llama"), tmp_path / "v.gguf")
    code = ("import sys; from service.contract.control_vector import read_control_vector; "
            "v = read_control_vector(sys.argv[1], d_model=16, n_layers=3); "
            "assert 'torch' not in sys.modules; print(v.layers, v.width)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tests" / "service" / "no_torch"), str(REPO)])}
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(1, 2) 16"
