"""The one ONNX Runtime session factory: export checks, the service and the benchmark.

Every session in the project is built here so thread counts, optimisation level and log
noise are set the same way everywhere. Provider *choice* (CPU or CUDA for a ``--device``)
is the service's business (service/providers.py); this only applies it.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import onnxruntime as ort

from service import ops

CPU = "CPUExecutionProvider"
Optimization = Literal["disable", "basic", "extended", "all"]
log = logging.getLogger(__name__)

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def create_session(model: str | Path | bytes, *, threads: int = 1,
                   providers: Sequence[str | tuple[str, dict[str, str]]] = (CPU,),
                   optimization: Optimization = "all",
                   save_optimized_to: Path | None = None,
                   prepack: bool = True,
                   external_data_dir: Path | None = None,
                   initializers: Mapping[str, ort.OrtValue] | None = None,
                   spin_wait: bool = True) -> ort.InferenceSession:
    """A session over a model file (or serialized bytes).

    ``threads`` is the intra-op pool (one thread by default: checks need exactness, and the
    serving tests run several servers on two cores); inter-op stays at 1 because decoder
    graphs are a chain. ``save_optimized_to`` writes the graph after optimisation.
    ``prepack=False`` leaves the weights where ONNX Runtime memory-mapped them from
    weights.bin instead of copying them into packed buffers: a graph run rarely (the
    attention dump) then costs page cache shared with the file, not a private copy.
    ``external_data_dir``: where the weights.bin of a model given as bytes lies (ONNX
    Runtime otherwise looks in the working directory). ``initializers``: tensors that
    replace the model's own of those names (several sessions can then share one mapping of
    the weights; the values must outlive the session). ``spin_wait=False``: the intra-op
    workers sleep when a run ends instead of spinning for more work, for a session that
    takes turns with another on the same cores (a draft model beside its target: a target
    step right after four spinning draft steps took 44.9 ms instead of 22.2 ms on SmolLM2).
    A graph over GGUF blocks (service/ops) runs on the op library where it loads, and
    otherwise on a dequantised copy (:func:`dequantised_copy`).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = _LEVELS[optimization]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if not spin_wait:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if save_optimized_to is not None:
        options.optimized_model_filepath = str(save_optimized_to)
    if uses_gguf_ops(model) and not ops.register(options):
        with tempfile.TemporaryDirectory(prefix="attnserve-dequantised-") as out:
            # the session has read (or mapped) the copy's weights once it exists
            path, gone = dequantised_copy(model, external_data_dir, Path(out))
            for name, value in (initializers or {}).items():
                if name not in gone:
                    options.add_initializer(name, value)
            return ort.InferenceSession(str(path), options, providers=list(providers))
    if external_data_dir is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(external_data_dir))
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=list(providers))


def uses_gguf_ops(model: str | Path | bytes) -> bool:
    """Whether a graph imports the GGUF ops' domain. Read from the serialized graph (the
    weights are in weights.bin, so a graph file is small) rather than parsed: the domain's
    name appears in the bytes of every graph that declares it, and only there."""
    data = model if isinstance(model, bytes) else Path(model).read_bytes()
    return ops.DOMAIN.encode() in data


def dequantised_copy(model: str | Path | bytes, external_data_dir: Path | None,
                     out_dir: Path) -> tuple[Path, set[str]]:
    """A GGUF-op graph rewritten into ONNX Runtime's own ops over float32 weights, in
    ``out_dir`` (service/ops/dequantised.py), said in one log line: where the op library
    is not built here, or not for this CPU (logged above), the model still serves, with
    more memory and slower. Returns the copy's path and the initializers it dropped."""
    from service.ops.dequantised import write_dequantised

    source = model if isinstance(model, bytes) else Path(model)
    path, gone, stored, dequantised = write_dequantised(source, external_data_dir, out_dir)
    what = "a graph" if isinstance(model, bytes) else Path(model).name
    log.warning("%s: GGUF blocks dequantised to float32 for ONNX Runtime's own MatMul and "
                "Gather (the op library is not loaded): %.0f MB of weights in place of %.0f "
                "MB, and slower; `make gguf-ops` (or %s) computes the blocks as stored",
                what, dequantised / 1e6, stored / 1e6, ops.ENV_VAR)
    return path, gone
