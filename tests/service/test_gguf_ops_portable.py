"""The portable GGUF op library (service/ops/build.py --portable, what the serving image
ships) on a CPU that lacks what it was compiled for: service.ops.library_path() reads the
flags build-info.json requires and returns None, with one log line, before anything loads
the library (which would die with SIGILL), and the session layer then serves the graph
with its blocks dequantised (service/ops/dequantised.py). Fake /proc/cpuinfo files; no
library is loaded."""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

import pytest

import service.ops
from service.ops import build

HASWELL = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe"
SANDY_BRIDGE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx"  # AVX, no AVX2/FMA/F16C


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: {flags}\n")
    return path


def portable_library(tmp_path: Path, **info: object) -> Path:
    """A stand-in for an installed portable build: a .so file (never loaded) and the
    build-info.json build.py writes for --portable."""
    directory = tmp_path / "gguf-ops"
    directory.mkdir()
    library = directory / build.LIBRARY_NAME
    library.write_bytes(b"\x7fELF not really")
    fields = {"machine": platform.machine(),
              "required_cpu_flags": list(build.PORTABLE_CPU_FLAGS), **info}
    (directory / build.INFO_FILE).write_text(json.dumps(fields))
    return library


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service.ops, "_warned", set())
    # The stand-in .so is never loaded: where the CPU passes, its level is taken as this
    # attnserve's (the level check itself: tests/service/ops/test_gguf_matmul.py).
    monkeypatch.setattr(service.ops, "library_level", lambda _: build.OPS_LEVEL)


def test_portable_build_requires_x86_64_v3_and_is_not_native() -> None:
    assert set(build.PORTABLE_CPU_FLAGS) >= {"avx2", "fma", "f16c", "bmi2"}
    args = build.cmake_args(portable=True)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_NATIVE=ON" not in args
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args
    assert not any("march=native" in a for a in args)
    assert build.cmake_args() == build.CMAKE_ARGS  # `make gguf-ops` stays native
    # its own key: no CPU signature, and never the native build's directory
    assert "portable" in build.build_key(portable=True)
    assert build.build_key(portable=True) != build.build_key()


def test_library_is_used_where_the_cpu_has_every_flag(tmp_path, monkeypatch) -> None:
    library = portable_library(tmp_path)
    monkeypatch.setattr(service.ops, "CPUINFO", cpuinfo(tmp_path, HASWELL))
    monkeypatch.setenv(service.ops.ENV_VAR, str(library))
    assert service.ops.library_path() == library
    assert service.ops.cpu_mismatch(library) is None


def test_cpu_without_avx2_gets_none_and_a_log_line(tmp_path, monkeypatch, caplog) -> None:
    library = portable_library(tmp_path)
    monkeypatch.setattr(service.ops, "CPUINFO", cpuinfo(tmp_path, SANDY_BRIDGE))
    monkeypatch.setenv(service.ops.ENV_VAR, str(library))
    caplog.set_level(logging.WARNING, logger="service.ops")
    assert service.ops.cpu_mismatch(library) == "this CPU lacks avx2 fma f16c bmi2"
    assert service.ops.library_path() is None
    assert service.ops.library_path() is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "service.ops"]
    assert len(warnings) == 1, warnings  # once, not at every call
    assert "lacks avx2 fma f16c bmi2" in warnings[0] and str(library) in warnings[0]

    class Options:
        def __init__(self) -> None:
            self.registered: list[str] = []

        def register_custom_ops_library(self, path: str) -> None:
            self.registered.append(path)

    options = Options()
    assert service.ops.register(options) is False
    assert options.registered == []  # never handed to ONNX Runtime: no dlopen, no SIGILL


def test_session_layer_serves_a_gguf_graph_dequantised(tmp_path, monkeypatch, caplog) -> None:
    """No AVX2: the stand-in library is never loaded (it would crash), and a Q4_0 product
    still runs, on ONNX Runtime's MatMul over gguf's dequantised weights, said in a line."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    from onnx import TensorProto, helper, numpy_helper

    from service.contract.sessions import create_session

    library = portable_library(tmp_path)
    monkeypatch.setattr(service.ops, "CPUINFO", cpuinfo(tmp_path, SANDY_BRIDGE))
    monkeypatch.setenv(service.ops.ENV_VAR, str(library))
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((16, 64)).astype(np.float32)
    stored = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_0)  # (16, 36) bytes
    node = helper.make_node(service.ops.MATMUL_OP, ["X", "W"], ["Y"], name="proj",
                            domain=service.ops.DOMAIN, ggml_type=2, k=64)
    graph = helper.make_graph([node], "q4_0", [helper.make_tensor_value_info(
        "X", TensorProto.FLOAT, [None, 64])], [helper.make_tensor_value_info(
            "Y", TensorProto.FLOAT, None)], initializer=[numpy_helper.from_array(stored, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(service.ops.DOMAIN, 1)])
    caplog.set_level(logging.WARNING)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    (y,) = create_session(model.SerializeToString()).run(None, {"X": x})
    reference = x.astype(np.float64) @ gguf.quants.dequantize(stored, 2).T.astype(np.float64)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)
    messages = [r.getMessage() for r in caplog.records]
    assert any("lacks avx2" in m for m in messages)
    assert any("dequantised to float32" in m for m in messages)


def test_unreadable_cpuinfo_or_another_machine_is_refused(tmp_path, monkeypatch) -> None:
    library = portable_library(tmp_path)
    monkeypatch.setattr(service.ops, "CPUINFO", tmp_path / "no-such-cpuinfo")
    monkeypatch.setenv(service.ops.ENV_VAR, str(library))
    assert service.ops.library_path() is None
    assert "unreadable" in (service.ops.cpu_mismatch(library) or "")
    (tmp_path / "arm").mkdir()
    other = portable_library(tmp_path / "arm", machine="not-" + platform.machine())
    monkeypatch.setattr(service.ops, "CPUINFO", cpuinfo(tmp_path, HASWELL))
    assert "built for not-" in (service.ops.cpu_mismatch(other) or "")


def test_native_builds_require_nothing(tmp_path, monkeypatch) -> None:
    """A `make gguf-ops` build records no required flags (its key holds this CPU's): it is
    used whatever cpuinfo says."""
    library = portable_library(tmp_path, required_cpu_flags=[], machine=None)
    monkeypatch.setattr(service.ops, "CPUINFO", cpuinfo(tmp_path, SANDY_BRIDGE))
    monkeypatch.setenv(service.ops.ENV_VAR, str(library))
    assert service.ops.library_path() == library
