"""The table of graphs: which graph a server opens, and which one runs a pass."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.contract.graphs import GraphEntry, GraphTable, graph_for_pass
from service.contract.manifest import FileEntry, Manifest

MODEL = GraphEntry("model.onnx", "fallback")
PLAIN = GraphEntry("engine.onnx", "steps")
MIXED = GraphEntry("engine_mixed.onnx", "steps", row_groups=2)
FLOAT32 = GraphEntry("engine_float32.onnx", "long passes", "float32", 2, 256)
QUANTISED = GraphTable((MODEL, PLAIN, MIXED, FLOAT32))


def test_a_pass_runs_on_float32_weights_from_their_threshold_on() -> None:
    served = QUANTISED.served(engine_graph=True, mixed_steps=True, on_cuda=False)
    assert served == (MIXED, FLOAT32)
    assert [graph_for_pass(served, t).file for t in (1, 32, 255, 256, 2048)] == [
        "engine_mixed.onnx"] * 3 + ["engine_float32.onnx"] * 2
    assert graph_for_pass(served[:1], 10_000) == MIXED  # none for long passes: steps graph


def test_settings_pick_the_steps_graph_and_override_the_threshold() -> None:
    plain = QUANTISED.served(engine_graph=True, mixed_steps=False, on_cuda=False,
                             float32_pass_tokens=64)
    assert plain == (PLAIN, replace(FLOAT32, from_tokens=64))
    assert graph_for_pass(plain, 64).weights == "float32"
    assert QUANTISED.served(engine_graph=True, mixed_steps=True, on_cuda=False,
                            float32_pass_tokens=0) == (MIXED,)  # 0: never opened
    assert QUANTISED.served(engine_graph=False, mixed_steps=True, on_cuda=False) == (MODEL,)


def test_the_other_steps_graph_serves_where_the_artifact_lacks_the_asked_one() -> None:
    only_mixed = GraphTable((MODEL, MIXED))
    assert only_mixed.served(engine_graph=True, mixed_steps=False, on_cuda=False) == (MIXED,)
    only_plain = GraphTable((MODEL, PLAIN))
    assert only_plain.served(engine_graph=True, mixed_steps=True, on_cuda=False) == (PLAIN,)


def test_on_cuda_only_a_float16_engine_graph_runs_and_alone() -> None:
    """engine.onnx of a float16 artifact (its decode steps captured), never the mixed or
    float32 graphs; model.onnx for any other artifact."""
    half = GraphTable.of_files(["model.onnx", "engine.onnx", "engine_mixed.onnx"],
                               "float16", 0, 2)
    model, mixed = (replace(e, kv_dtype="float16") for e in (MODEL, MIXED))
    cuda_plain = replace(PLAIN, cuda=True, kv_dtype="float16")
    assert half.graphs == (model, cuda_plain, mixed)
    assert half.served(engine_graph=True, mixed_steps=True, on_cuda=True) == (cuda_plain,)
    assert half.served(engine_graph=True, mixed_steps=True, on_cuda=False) == (mixed,)
    assert QUANTISED.served(engine_graph=True, mixed_steps=True, on_cuda=True) == (MODEL,)


def _manifest(files: list[str], quantization: str | None, **exporter: object) -> Manifest:
    return Manifest(files={n: FileEntry("0" * 64, 1) for n in files}, source_checkpoint={},
                    exporter=dict(exporter), opset=18, kv_dtype="float32",
                    quantization=quantization, io={}, verification={})


@pytest.mark.parametrize(("quantization", "exporter", "tokens"), [
    ("gguf", {"float32_pass_tokens": 300}, 300),  # recorded by the export of then
    ("gguf", {}, 256),  # older still: what export measured for the quantisation
    ("int8", {}, 1024),
])
def test_a_manifest_without_the_table_is_read_from_its_files(
        quantization: str, exporter: dict[str, object], tokens: int) -> None:
    """The graphs an older artifact holds, the 8-bit codes' (no longer served) left out;
    the float32 graph's row groups as exported (``engine_mixed_steps``)."""
    files = ["model.onnx", "attention.onnx", "engine.onnx", "engine_float32.onnx",
             "engine_codes8.onnx", "engine_codes8_plain.onnx", "weights.bin"]
    table = GraphTable.of(_manifest(files, quantization, engine_mixed_steps=False, **exporter))
    assert table.graphs == (MODEL, PLAIN, replace(FLOAT32, row_groups=1, from_tokens=tokens))
    recorded = _manifest(files, quantization, **exporter)
    recorded.graphs = GraphTable((MODEL, MIXED)).to_list()
    assert GraphTable.of(recorded).graphs == (MODEL, MIXED)  # the table, when there


def test_the_table_round_trips_through_the_manifest_json() -> None:
    assert GraphTable.from_list(QUANTISED.to_list()) == QUANTISED
    assert all(entry.describe().startswith(entry.file) for entry in QUANTISED.graphs)


ADAPTED = GraphTable.of_files(["model.onnx", "attention.onnx", "attention_lora.onnx",
                               "engine.onnx", "engine_mixed.onnx", "engine_float32.onnx",
                               "engine_lora.onnx", "engine_mixed_lora.onnx"],
                              "float32", 256, 2)


def test_served_with_adapters_picks_the_lora_steps_graph_alone() -> None:
    """Each steps graph's adapter twin is in the table (same row groups, never CUDA);
    served(adapters=True) opens it alone, no float32 long-pass graph; without the keyword
    the table serves as before."""
    lora, mixed_lora = (replace(PLAIN, file="engine_lora.onnx", adapters=True),
                        replace(MIXED, file="engine_mixed_lora.onnx", adapters=True))
    assert ADAPTED.graphs == (MODEL, PLAIN, MIXED, FLOAT32, lora, mixed_lora)
    assert ADAPTED.served(engine_graph=True, mixed_steps=True, on_cuda=False,
                          adapters=True) == (mixed_lora,)
    assert ADAPTED.served(engine_graph=True, mixed_steps=False, on_cuda=False,
                          adapters=True) == (lora,)
    assert ADAPTED.served(engine_graph=True, mixed_steps=True, on_cuda=False) == (MIXED,
                                                                                   FLOAT32)
    assert "LoRA adapters" in mixed_lora.describe()
    half = GraphTable.of_files(["model.onnx", "engine.onnx", "engine_lora.onnx"], "float16",
                               0, 1)
    assert half.served(engine_graph=True, mixed_steps=True, on_cuda=True) == (
        replace(PLAIN, cuda=True, kv_dtype="float16"),)  # the adapter graph is no CUDA graph
    assert not half.graphs[-1].cuda


@pytest.mark.parametrize("engine_graph, on_cuda", [(True, True), (False, False)])
def test_adapters_are_refused_off_the_cpus_engine_graph(engine_graph: bool,
                                                        on_cuda: bool) -> None:
    """The one place that says where adapters run: the server's check and the engine's."""
    with pytest.raises(ValueError, match=r"^LoRA adapters are served by the engine graph on "
                                         r"the CPU only \(--device cpu, --engine-graph\)$"):
        ADAPTED.served(engine_graph=engine_graph, mixed_steps=True, on_cuda=on_cuda,
                       adapters=True)


def test_an_artifact_without_an_adapter_graph_refuses_adapters_in_one_line() -> None:
    old = GraphTable.of(_manifest(["model.onnx", "engine.onnx", "engine_mixed.onnx"], None,
                                  engine_mixed_steps=True))
    with pytest.raises(ValueError, match=r"^this artifact has no adapter graph \(exported "
                                         r"before adapters were served\): export it again$"):
        old.served(engine_graph=True, mixed_steps=True, on_cuda=False, adapters=True)


def test_a_table_row_of_before_adapters_reads_as_without_them() -> None:
    row = {"file": "engine_mixed.onnx", "runs": "steps", "weights": "stored",
           "row_groups": 2, "from_tokens": 0, "cuda": False}  # a manifest of before
    (entry,) = GraphTable.from_list([row]).graphs
    assert entry == MIXED and entry.adapters is False
    assert GraphTable.from_list(ADAPTED.to_list()) == ADAPTED


def test_a_float16_cache_in_the_cpu_engine_graphs_alone() -> None:
    """--kv-dtype float16 over the GGUF ops: the steps graphs (and their adapter graphs) take
    a float16 cache, model.onnx keeps the manifest's float32 one, and none runs on CUDA."""
    files = ["model.onnx", "engine.onnx", "engine_mixed.onnx", "engine_lora.onnx"]
    table = GraphTable.of_files(files, "float32", 0, 2, ggml=files, engine_kv_dtype="float16")
    assert {g.file: (g.kv_dtype, g.cuda) for g in table.graphs} == {
        "model.onnx": ("float32", False), "engine.onnx": ("float16", False),
        "engine_mixed.onnx": ("float16", False), "engine_lora.onnx": ("float16", False)}
    assert "float16 KV cache" in table.graphs[1].describe()
    assert GraphTable.from_list(table.to_list()) == table


def test_rows_of_before_the_cache_type_read_as_the_manifests() -> None:
    """A table written before entries named their cache: every graph's is the manifest's
    (a float16 artifact's engine.onnx keeps its float16 pool)."""
    rows = [{k: v for k, v in row.items() if k != "kv_dtype"}
            for row in GraphTable((MODEL, replace(PLAIN, cuda=True))).to_list()]
    assert {g.kv_dtype for g in GraphTable.from_list(rows, "float16").graphs} == {"float16"}
    assert {g.kv_dtype for g in GraphTable.from_list(rows).graphs} == {"float32"}


def test_an_entry_refuses_a_session_of_another_cache_type() -> None:
    from service.contract.graphs import GraphInterface

    interface = GraphInterface(frozenset({"input_ids"}), frozenset({"logits"}), True,
                               "float16")
    with pytest.raises(ValueError, match=r"engine\.onnx takes a float16 KV cache where the "
                                         r"artifact's table says float32"):
        PLAIN.check(interface)
    replace(PLAIN, kv_dtype="float16").check(interface)
