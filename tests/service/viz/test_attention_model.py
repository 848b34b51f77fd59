"""The attention session computes only the layers asked for (service/viz/attention_model.py
and graph_cut.py).

References: the whole attention.onnx run by ONNX Runtime with the same fetches (values must
be identical), and the onnx package's own Extractor for which nodes a set of outputs needs.
ONNX Runtime's profiler counts the kernels a run executes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.contract import io_spec as io
from service.contract import sessions
from service.providers import create_session
from service.viz.attention_model import CUT_SESSIONS, AttentionModel
from service.viz.graph_cut import cut

onnx = pytest.importorskip("onnx", reason="onnx (export extra) is the reference parser")


@pytest.fixture(scope="module")
def config(artifact: Path) -> io.ArtifactConfig:
    return io.ArtifactConfig.load(artifact)


@pytest.fixture(scope="module")
def full(artifact: Path) -> ort.InferenceSession:
    return create_session(artifact / io.ATTENTION_FILE, "cpu", 1, prepack=False)


def feeds(ids: list[int]) -> dict[str, np.ndarray]:
    x = np.asarray([ids], np.int64)
    return {io.INPUT_IDS: x, io.ATTENTION_MASK: np.ones_like(x),
            io.POSITION_IDS: np.arange(len(ids), dtype=np.int64)[None]}


def test_requested_layers_equal_the_whole_graph_in_the_order_asked(
        artifact: Path, config: io.ArtifactConfig, full: ort.InferenceSession) -> None:
    model = AttentionModel(full, config, artifact / io.ATTENTION_FILE)
    ids = list(range(5, 45))
    last = config.n_layers - 1
    got = model.run(ids, ["weights", "q"], [last, 0])
    names = [io.attention_output_name(i, k) for k in ("weights", "q") for i in (last, 0)]
    want = full.run(names, feeds(ids))
    assert got["weights"].shape == (2, config.n_heads, 40, 40)
    assert got["q"].shape == (2, config.n_heads, 40, config.head_dim)
    np.testing.assert_array_equal(got["weights"][0], want[0][0])
    np.testing.assert_array_equal(got["weights"][1], want[1][0])
    np.testing.assert_array_equal(got["q"][0], want[2][0])
    np.testing.assert_array_equal(got["q"][1], want[3][0])
    assert model.sessions_built == 1

    # All layers by default: the whole graph, as a session over the shared weights.
    everything = model.run(ids, list(io.ATTENTION_KINDS))
    assert model.sessions_built == 2
    assert everything["weights"].shape[0] == config.n_layers
    np.testing.assert_array_equal(everything["weights"][last], want[0][0])


def test_cut_sessions_share_one_mapping_of_the_weights(artifact: Path, config: io.ArtifactConfig,
                                                       full: ort.InferenceSession) -> None:
    """ONNX Runtime maps weights.bin itself for every session it loads (one mapping per
    initializer); the cut sessions take the initializers from one mapping made here."""
    weights = str((artifact / "weights.bin").resolve())

    def mappings() -> int:
        return sum(line.rstrip().endswith(weights)
                   for line in Path("/proc/self/maps").read_text().splitlines())

    before = mappings()
    model = AttentionModel(full, config, artifact / io.ATTENTION_FILE)
    for layers in ([0], [1], None, [1, 0]):
        model.run([5, 6, 7], ["weights", "v"], layers)
    assert config.n_layers == 2  # so [1, 0] asks for what None did: the same session
    assert model.sessions_built == 3
    assert mappings() == before + 1


def test_cut_sessions_are_kept_a_few_at_a_time(artifact: Path, config: io.ArtifactConfig,
                                               full: ort.InferenceSession) -> None:
    model = AttentionModel(full, config, artifact / io.ATTENTION_FILE)
    ids = [3, 4, 5]
    asks = [[0], [1], [0, 1]]
    kinds = [["weights"], ["q"], ["k"], ["v"]]
    for kind in kinds:
        for layers in asks:
            model.run(ids, kind, layers)
    assert model.sessions_built == len(kinds) * len(asks)
    model.run(ids, ["v"], [0, 1])  # the most recent: kept
    assert model.sessions_built == len(kinds) * len(asks)
    assert len(model._cut) == CUT_SESSIONS


def test_without_the_source_every_request_runs_the_given_session(
        config: io.ArtifactConfig, full: ort.InferenceSession) -> None:
    model = AttentionModel(full, config)
    got = model.run([7, 8, 9], ["scores"], [1])
    want = full.run([io.attention_output_name(1, "scores")], feeds([7, 8, 9]))
    np.testing.assert_array_equal(got["scores"][0], want[0][0])
    assert model.sessions_built == 0


def _signature(nodes: object) -> list[tuple[str, tuple[str, ...]]]:
    return sorted((n.op_type, tuple(n.output)) for n in nodes)  # type: ignore[attr-defined]


def test_a_cut_graph_holds_exactly_the_nodes_its_outputs_need(artifact: Path,
                                                               config: io.ArtifactConfig) -> None:
    source = (artifact / io.ATTENTION_FILE).read_bytes()
    whole = onnx.load_from_string(source)
    inputs = [i.name for i in whole.graph.input]
    for outputs in ([io.attention_output_name(0, "weights")],
                    [io.attention_output_name(config.n_layers - 1, "scaled_scores"),
                     io.attention_output_name(0, "v")]):
        mine = onnx.load_from_string(cut(source, outputs))
        reference = onnx.utils.Extractor(whole).extract_model(inputs, outputs)
        assert [o.name for o in mine.graph.output] == [o.name for o in whole.graph.output
                                                       if o.name in outputs]
        assert _signature(mine.graph.node) == _signature(reference.graph.node)
        assert len(mine.graph.node) < len(whole.graph.node)
        # Everything else is carried over: opsets, initializers and their external data.
        assert list(mine.opset_import) == list(whole.opset_import)
        assert [t.name for t in mine.graph.initializer] == [t.name for t in
                                                            whole.graph.initializer]
        assert mine.graph.initializer[0].external_data == whole.graph.initializer[0].external_data


def test_a_cut_session_runs_only_its_layers_kernels(artifact: Path, config: io.ArtifactConfig,
                                                    tmp_path: Path) -> None:
    """ONNX Runtime itself runs every node whatever is fetched; the cut graph does not."""
    def kernels(model: bytes, fetch: str) -> int:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / "profile")
        options.intra_op_num_threads = 1
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(artifact))
        session = ort.InferenceSession(model, options, providers=[sessions.CPU])
        session.run([fetch], feeds([5, 6, 7, 8]))
        events = json.loads(Path(session.end_profiling()).read_text())
        return sum(e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                   for e in events)

    source = (artifact / io.ATTENTION_FILE).read_bytes()
    first = io.attention_output_name(0, "weights")
    whole, alone = kernels(source, first), kernels(cut(source, [first]), first)
    assert alone < whole / config.n_layers + 10  # layer 0 and the embedding, nothing after
    last = io.attention_output_name(config.n_layers - 1, "weights")
    assert kernels(source, last) == whole


def test_bad_cuts_are_refused() -> None:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    then = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "then",
                                  [], [y])
    cond = onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)],
        "g", [cond, x], [y])
    model = onnx.helper.make_model(graph).SerializeToString()
    with pytest.raises(ValueError, match="control flow"):
        cut(model, ["y"])
    with pytest.raises(ValueError, match="not outputs"):
        cut(model, ["nothing"])
