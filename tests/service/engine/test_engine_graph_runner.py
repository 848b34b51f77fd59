"""Both runners over the KV pool (engine.onnx bound in place, model.onnx gathered) drive
the same Batch to the same tokens, with joins, leaves, prefix caching and chunked prefill.

The reference is the plain model.onnx loop of conftest (batch 1, session.run, argmax); the
engine graph is built here from the tiny checkpoint (the test process may use torch; the
served process never does), also as exported before ``logits_index`` existed (every fed
position's logits), which the runner still serves.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE, LOGITS_INDEX
from service.contract.graphs import GraphEntry
from service.contract.reference import OrtDecoder
from service.engine.batch import Batch
from service.engine.engine import EngineConfig, create_runner
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.model_graph_runner import ModelGraphRunner
from service.engine.pooled_runner import PooledRunner
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.runner import PoolConfig
from service.engine.sampling import log_softmax
from service.engine.step import Step, run_step
from service.engine.step_plan import RowWork, StepPlan
from service.providers import create_session
from tests.service.helpers import one_step, record_graphs, run_with_joins
from tests.service.runner_passes import decode, extend, prefill

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O"]


@pytest.fixture(scope="module")
def session(engine_artifact: Path) -> ort.InferenceSession:
    return create_session(engine_artifact / ENGINE_FILE, "cpu", 1)


@pytest.fixture(scope="module")
def legacy_session(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> ort.InferenceSession:
    """engine.onnx without the ``logits_index`` input, as older artifacts hold it."""
    from export.onnx.engine_graph import export_engine
    from model.checkpoint import load_checkpoint

    path = tmp_path_factory.mktemp("legacy-engine") / ENGINE_FILE
    export_engine(load_checkpoint(tiny_checkpoint).model.eval(), path, logits_index=False)
    session = create_session(path, "cpu", 1)
    assert LOGITS_INDEX not in {i.name for i in session.get_inputs()}
    return session


@pytest.fixture(scope="module")
def mixed_session(mixed_engine_path: Path) -> ort.InferenceSession:
    return create_session(mixed_engine_path, "cpu", 1)


@pytest.fixture(scope="module")
def config(engine_artifact: Path) -> io.ArtifactConfig:
    return io.ArtifactConfig.load(engine_artifact)


@pytest.fixture
def engine(session: ort.InferenceSession, config: io.ArtifactConfig) -> EngineGraphRunner:
    """A fresh pool (8 slots, no prefix cache) over the shared session."""
    return EngineGraphRunner(session, config, PoolConfig(slots=8))


@pytest.fixture(scope="module")
def model_session(artifact: Path) -> ort.InferenceSession:
    return create_session(artifact / io.MODEL_FILE, "cpu", 1)


@pytest.fixture(params=["engine.onnx", "engine_mixed.onnx", "legacy engine.onnx",
                        "model.onnx", "model.onnx, cache left in ORT"])
def runner(request: pytest.FixtureRequest, session: ort.InferenceSession,
           mixed_session: ort.InferenceSession, legacy_session: ort.InferenceSession,
           model_session: ort.InferenceSession, config: io.ArtifactConfig) -> PooledRunner:
    """Either runner over a fresh pool of 8 slots (engine.onnx with or without
    ``logits_index``, with one group of rows or two; model.onnx with the past gathered
    from the pool, or kept in ONNX Runtime between steps as under CUDA)."""
    if request.param == "engine.onnx":
        return EngineGraphRunner(session, config, PoolConfig(slots=8))
    if request.param == "engine_mixed.onnx":
        runner = EngineGraphRunner(mixed_session, config, PoolConfig(slots=8))
        assert runner.mixes_chunks
        return runner
    if request.param == "legacy engine.onnx":
        return EngineGraphRunner(legacy_session, config, PoolConfig(slots=8))
    if request.param == "model.onnx":
        return ModelGraphRunner(model_session, config, PoolConfig(slots=8))
    return ModelGraphRunner(model_session, config, PoolConfig(slots=8), resident=True)


@pytest.fixture(scope="module")
def plain(artifact: Path) -> OrtDecoder:
    """The plain loop's decoder: model.onnx by the contract's names, no engine code."""
    return OrtDecoder.from_artifact(artifact)


def full_forward(dec: OrtDecoder, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits (T, V) and presents, each (nkv, T, hs), of one sequence from scratch."""
    logits, present = dec(np.asarray([ids], np.int64), np.ones((1, len(ids)), np.int64),
                          np.arange(len(ids), dtype=np.int64)[None, :], dec.empty_past(1))
    return logits[0], [p[0] for p in present]


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


def request(ids: list[int], max_new: int, prompt_logprobs: bool = False) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(), StoppingCriteria(max_new, (), None),
                             prompt_logprobs=prompt_logprobs)


def test_batched_greedy_equals_the_reference_loop_with_joins_and_leaves(
        runner: PooledRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    lengths = [12, 70, 7, 21, 66]
    requests = [request(encode(p), n) for p, n in zip(PROMPTS, lengths, strict=True)]
    waves = [requests[:2], requests[2:3], requests[3:]]
    got = run_with_joins(runner, codec, waves, join_every=4)
    assert runner.pool.used == 0 and runner.pool.tokens_held == 0
    for r in requests:
        assert got[r.id] == reference_greedy(r.prompt_ids, r.stopping.max_new_tokens), r.id


def test_logits_equal_the_plain_loop_for_ragged_prompts_and_decode(
        runner: PooledRunner, plain: OrtDecoder, encode: Callable[[str], list[int]]) -> None:
    prompts = [encode(PROMPTS[1]), encode(PROMPTS[2]), encode(PROMPTS[4])]
    slots = runner.reserve(3)
    got = prefill(runner, slots, [np.asarray(p) for p in prompts], every=True)
    seqs = [list(p) for p in prompts]
    for rows, p in zip(got, prompts, strict=True):
        np.testing.assert_allclose(rows, full_forward(plain, p)[0], atol=1e-4)  # (T, V)
    arrays = [a.ctypes.data for a in runner.pool.arrays]
    for _ in range(5):
        nxt = np.asarray([int(full_forward(plain, s)[0][-1].argmax()) for s in seqs])  # (B,)
        for s, t in zip(seqs, nxt, strict=True):
            s.append(int(t))
        logits = decode(runner, slots, nxt)  # (B, V)
        want = np.stack([full_forward(plain, s)[0][-1] for s in seqs])
        np.testing.assert_allclose(logits, want, atol=1e-4)
    # Every step wrote into the pool allocated at start: no new cache.
    assert [a.ctypes.data for a in runner.pool.arrays] == arrays
    assert [runner.pool.lengths[s.index] for s in slots] == [len(p) + 5 for p in prompts]
    assert runner.pool.moves == 0


def test_pool_holds_each_rows_keys_and_values_from_column_zero(
        runner: PooledRunner, plain: OrtDecoder, encode: Callable[[str], list[int]]) -> None:
    """The pool slot of each row holds the keys/values the plain loop computes, unpadded,
    after a batched prefill and after a multi-token extend."""
    prompts = [encode(PROMPTS[0]), encode(PROMPTS[3])]
    slots = runner.reserve(2)
    prefill(runner, slots, [np.asarray(p) for p in prompts])
    more = encode(" my lord")
    extend(runner, slots[0], np.asarray(more))
    for slot, ids in zip(slots, [prompts[0] + more, prompts[1]], strict=True):
        _, present = full_forward(plain, ids)
        for mine, theirs in zip(runner.pool.arrays, present, strict=True):
            np.testing.assert_allclose(mine[slot.index, :, :len(ids)], theirs, atol=1e-5)
        assert runner.pool.tokens[slot.index, :len(ids)].tolist() == ids
    assert runner.kv_stats().tokens == len(prompts[0]) + len(more) + len(prompts[1])


def test_extend_gives_logits_of_every_fed_token_and_truncate_rolls_back(
        runner: PooledRunner, plain: OrtDecoder, encode: Callable[[str], list[int]]) -> None:
    """What speculative decoding needs: feed several drafted tokens in one pass, read the
    logits after each, keep a prefix, and decode on as if the rest had never been fed."""
    prompt = encode(PROMPTS[1])
    (slot,) = runner.reserve(1)
    prefill(runner, [slot], [np.asarray(prompt)])
    drafts = encode(" and the rest")  # tokens a draft model might propose
    logits = extend(runner, slot, np.asarray(drafts))  # (k, V)
    want, _ = full_forward(plain, prompt + drafts)
    np.testing.assert_allclose(logits, want[len(prompt):], atol=1e-4)
    runner.truncate(slot, len(prompt) + 2)  # two drafts accepted, the rest rejected
    assert runner.pool.lengths[slot.index] == len(prompt) + 2
    bonus = 7
    got = decode(runner, [slot], np.asarray([bonus]))  # (1, V)
    kept = prompt + drafts[:2] + [bonus]
    np.testing.assert_allclose(got[0], full_forward(plain, kept)[0][-1], atol=1e-4)
    _, present = full_forward(plain, kept)
    runner.settle()
    for mine, theirs in zip(runner.pool.arrays, present, strict=True):
        np.testing.assert_allclose(mine[slot.index, :, :len(kept)], theirs, atol=1e-5)
    with pytest.raises(ValueError, match="truncate"):
        runner.truncate(slot, len(kept) + 1)


def test_a_leave_moves_at_most_one_row_and_only_its_tokens(
        engine: EngineGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    reqs = [request(encode(p), 40) for p in PROMPTS[:4]]
    batch = Batch.from_requests(reqs, codec, engine.vocab_size)
    one_step(engine, batch)
    pool = engine.pool
    assert [s.index for s in batch.slots] == [0, 1, 2, 3] and pool.used == 4
    before = [a[3, :, :pool.lengths[3]].copy() for a in pool.arrays]  # row 3's cache
    untouched = [a[0, :, :pool.lengths[0]].copy() for a in pool.arrays]
    batch.filter([0, 2, 3], engine)  # row 1 leaves: the highest row (3) fills its slot
    assert pool.moves == 1 and pool.used == 3
    assert [s.index for s in batch.slots] == [0, 2, 1]
    for a, b, c in zip(pool.arrays, before, untouched, strict=True):
        np.testing.assert_array_equal(a[1, :, :b.shape[1]], b)
        np.testing.assert_array_equal(a[0, :, :c.shape[1]], c)
    batch.filter([0, 1], engine)  # the row in slot 1 leaves; slot 2 is the top: one move
    assert pool.moves == 2 and [s.index for s in batch.slots] == [0, 1]
    batch.filter([0], engine)  # the top row leaves: nothing moves
    assert pool.moves == 2 and pool.used == 1
    batch.release(engine)
    assert pool.used == 0 and pool.tokens_held == 0
    # A leave at the bottom refills the bottom slot: the batch never drifts up the pool.
    batch = Batch.from_requests(reqs[:3], codec, engine.vocab_size)
    one_step(engine, batch)
    batch.filter([1, 2], engine)
    assert sorted(s.index for s in batch.slots) == [0, 1] and pool.moves == 3
    batch.release(engine)


def test_prefix_cache_reuses_blocks_and_changes_no_token(
        session: ort.InferenceSession, config: io.ArtifactConfig, codec: TextCodec,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    cached = EngineGraphRunner(session, config, PoolConfig(slots=8, prefix_block_size=4,
                                                          prefix_cache_blocks=64))
    system = encode("You are a helpful assistant. Answer in the style of Shakespeare.\n")
    prompts = [system + encode(p) for p in PROMPTS]
    first = [request(prompts[0], 10)]
    got = run_with_joins(cached, codec, [first], join_every=1)
    assert cached.prefix is not None and cached.prefix.counters.hits == 0
    later = [request(p, n) for p, n in zip(prompts[1:], [9, 14, 5, 20], strict=True)]
    got |= run_with_joins(cached, codec, [later[:2], later[2:]], join_every=3)
    for r in first + later:
        assert got[r.id] == reference_greedy(r.prompt_ids, r.stopping.max_new_tokens), r.id
    reusable = (len(system) // 4) * 4
    assert cached.prefix.counters.hits >= 4 * reusable  # each later prompt reused the prefix
    stats = cached.prefix_stats()
    assert stats is not None and 0 < stats.blocks <= 64
    # The same prompt again reuses all of its full blocks but its last token's.
    again = request(prompts[0], 10)
    hits = cached.prefix.counters.hits
    assert run_with_joins(cached, codec, [[again]], join_every=1)[again.id] == got[first[0].id]
    assert cached.prefix.counters.hits - hits == ((len(prompts[0]) - 1) // 4) * 4


def test_prefix_cache_memory_is_bounded_with_lru_eviction(
        session: ort.InferenceSession, config: io.ArtifactConfig, codec: TextCodec,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    cached = EngineGraphRunner(session, config, PoolConfig(slots=8, prefix_block_size=4,
                                                          prefix_cache_blocks=8))
    prefix = cached.prefix
    assert prefix is not None
    store = prefix.store.ctypes.data
    a, b = request(encode(PROMPTS[1]), 8), request(encode(PROMPTS[3]), 8)
    assert len(a.prompt_ids) > 8 and len(b.prompt_ids) > 8
    got = run_with_joins(cached, codec, [[a]], join_every=1)
    full_a = prefix.match(np.asarray(a.prompt_ids))
    assert full_a == min((len(a.prompt_ids) - 1) // 4, 8) * 4
    got |= run_with_joins(cached, codec, [[b]], join_every=1)  # b's blocks push a's out
    for r in (a, b):
        assert got[r.id] == reference_greedy(r.prompt_ids, 8)
    assert prefix.blocks_used <= 8 and prefix.counters.evicted > 0
    assert prefix.store.ctypes.data == store  # allocated once, never grown
    assert prefix.match(np.asarray(b.prompt_ids)) == min((len(b.prompt_ids) - 1) // 4, 8) * 4
    assert prefix.match(np.asarray(a.prompt_ids)) < full_a


def test_chunked_prefill_equals_the_reference_loop(
        runner: PooledRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """A long prompt fed in chunks of 5 while another row decodes, one chunk a step (on
    engine_mixed.onnx riding in the decode pass, elsewhere a pass of its own), the last
    chunk bringing the first token; both requests get the reference loop's tokens."""
    ids = encode(PROMPTS[1] + " " + PROMPTS[3])
    running = Batch.from_requests([request(encode(PROMPTS[0]), 30)], codec, runner.vocab_size)
    tokens = [one_step(runner, running)[0].token.id]
    long = Batch.from_requests([request(ids, 12)], codec, runner.vocab_size)
    long.reserve(runner, top=True)
    chunks, out = 0, []
    while long.prompt_left > 0:
        step = run_step(runner, Step().add(runner, running).add(runner, long, chunk=5))
        (row, chunk) = step.rows
        out = [e.token.id for e in chunk.events]
        assert bool(out) == (long.prompt_left == 0) == chunk.samples
        chunks += 1
        tokens.append(row.events[0].token.id)
    assert chunks == -(-len(ids) // 5)
    merged = Batch.concatenate([running, long], runner)
    while len(out) < 12:
        events = one_step(runner, merged)
        tokens.append(events[0].token.id)
        out.append(events[1].token.id)
    assert out == reference_greedy(ids, 12)
    assert tokens == reference_greedy(encode(PROMPTS[0]), len(tokens))


def test_slots_shorter_than_the_context_decode_the_reference_tokens(
        session: ort.InferenceSession, config: io.ArtifactConfig, codec: TextCodec,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """A pool sized by max_total_tokens (48 here, the model's context is longer) gives the
    plain loop's tokens for requests that fit, and holds 48 tokens per slot."""
    assert config.max_seq_len > 48
    short = EngineGraphRunner(session, config, PoolConfig(slots=4, max_len=48))
    assert short.kv_stats().bytes_allocated == 4 * 48 * 2 * config.n_layers * \
        config.d_model * 4
    requests = [request(encode(p), 48 - len(encode(p))) for p in PROMPTS[:3]]
    got = run_with_joins(short, codec, [requests[:2], requests[2:]], join_every=5)
    for r in requests:
        assert got[r.id] == reference_greedy(r.prompt_ids, r.stopping.max_new_tokens), r.id
    with pytest.raises(ValueError, match="must be 2"):
        EngineGraphRunner(session, config, PoolConfig(slots=1, max_len=config.max_seq_len + 1))


def test_a_pool_larger_than_the_memory_available_is_refused_before_allocating(
        session: ort.InferenceSession, config: io.ArtifactConfig,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner asks the pool's reader of available memory, once, before allocating: a
    pool of exactly what is available is made, one slot more is refused. The figure is
    given to it here, so nothing another process does in between can move it."""
    from service.engine import kv_pool

    slot = config.max_seq_len * 2 * config.n_layers * config.d_model * 4
    monkeypatch.setattr(kv_pool, "memory_available", lambda: 40 * slot)
    fits = EngineGraphRunner(session, config, PoolConfig(slots=40))
    assert fits.kv_stats().capacity_tokens == 40 * config.max_seq_len
    with pytest.raises(MemoryError, match="--max-total-tokens or --max-batch-size"):
        EngineGraphRunner(session, config, PoolConfig(slots=41))
    # The same slots under a token budget that fits: the check counts the budget, not
    # slots x max_len (the pool's pages are committed only as tokens are written).
    budget = EngineGraphRunner(session, config, PoolConfig(slots=41, budget_tokens=64))
    assert budget.kv_stats().capacity_tokens == 64


def test_a_pool_larger_than_the_machine_is_refused_by_the_live_figure(
        session: ort.InferenceSession, config: io.ArtifactConfig) -> None:
    """End to end, with the real reader: a pool twice the machine's physical memory
    (MemTotal, which MemAvailable and any container headroom never exceed, however much
    other processes free meanwhile) is refused before anything is allocated."""
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) * 1024 for line in meminfo
                 if line.startswith("MemTotal:"))
    slot = config.max_seq_len * 2 * config.n_layers * config.d_model * 4
    slots = 2 * total // slot + 1
    with pytest.raises(MemoryError, match="--max-total-tokens or --max-batch-size"):
        EngineGraphRunner(session, config, PoolConfig(slots=int(slots)))


def test_create_runner_falls_back_to_model_onnx_through_the_pool(
        engine_artifact: Path, artifact: Path) -> None:
    config = io.ArtifactConfig.load(artifact)
    one = EngineConfig(intra_op_threads=1, max_batch_size=3, prefix_caching=False)
    assert isinstance(create_runner(artifact, config, one), ModelGraphRunner)
    assert isinstance(create_runner(engine_artifact, config, EngineConfig(
        intra_op_threads=1, engine_graph=False, max_batch_size=3)), ModelGraphRunner)
    sized = create_runner(engine_artifact, config, one)
    assert isinstance(sized, EngineGraphRunner)
    assert sized.pool.slots == 3 and sized.prefix_stats() is None
    assert sized.kv_stats().bytes_allocated == 3 * config.max_seq_len * (
        2 * config.n_layers * config.d_model * 4)


def test_create_runner_takes_the_mixed_graph_unless_mixed_steps_are_off(
        engine_artifact: Path, mixed_engine_path: Path, tmp_path: Path) -> None:
    """An artifact with engine_mixed.onnx beside engine.onnx: the runner opens the mixed
    one by default (``decode_graph`` says so), engine.onnx with ``mixed_steps`` off, and
    engine.onnx where there is no mixed one."""
    both = tmp_path / "both"
    shutil.copytree(engine_artifact, both)
    shutil.copyfile(mixed_engine_path, both / ENGINE_MIXED_FILE)
    record_graphs(both)
    config = io.ArtifactConfig.load(both)
    on = create_runner(both, config, EngineConfig(intra_op_threads=1, max_batch_size=2))
    off = create_runner(both, config, EngineConfig(intra_op_threads=1, max_batch_size=2,
                                                   mixed_steps=False))
    plain = create_runner(engine_artifact, config, EngineConfig(intra_op_threads=1,
                                                                max_batch_size=2))
    assert (on.graph_file, on.mixes_chunks) == (ENGINE_MIXED_FILE, True)
    assert (off.graph_file, off.mixes_chunks) == (ENGINE_FILE, False)
    assert (plain.graph_file, plain.mixes_chunks) == (ENGINE_FILE, False)


def test_a_table_entry_the_session_does_not_compute_is_refused(
        session: ort.InferenceSession, mixed_session: ort.InferenceSession,
        config: io.ArtifactConfig) -> None:
    """The graph table's entry is what every pass reads of a graph (row groups, adapters):
    a session whose inputs say otherwise is refused when the runner is made, not at a
    pass that binds a group the graph lacks."""
    mixed = GraphEntry(ENGINE_MIXED_FILE, "steps", row_groups=2)
    with pytest.raises(ValueError, match=r"does not compute what engine_mixed\.onnx does"):
        EngineGraphRunner(session, config, PoolConfig(slots=2), steps=mixed)
    with pytest.raises(ValueError, match=r"does not compute what engine\.onnx does"):
        EngineGraphRunner(mixed_session, config, PoolConfig(slots=2),
                          steps=GraphEntry(ENGINE_FILE, "steps"))
    lora = GraphEntry(ENGINE_MIXED_FILE, "steps", row_groups=2, adapters=True)
    with pytest.raises(ValueError, match="does not compute"):
        EngineGraphRunner(mixed_session, config, PoolConfig(slots=2), steps=lora)
    runner = EngineGraphRunner(mixed_session, config, PoolConfig(slots=2), steps=mixed)
    assert (runner.graph_file, runner.mixes_chunks, runner.graphs) == (
        ENGINE_MIXED_FILE, True, (mixed,))


def test_prompt_logprobs_through_the_batch_match_the_plain_loop(
        runner: PooledRunner, plain: OrtDecoder, codec: TextCodec,
        encode: Callable[[str], list[int]]) -> None:
    reqs = [request(encode(PROMPTS[2]), 1), request(encode(PROMPTS[1]), 1, prompt_logprobs=True)]
    batch = Batch.from_requests(reqs, codec, runner.vocab_size)
    one_step(runner, batch)
    got = batch.sequences[1].prefill
    ids = reqs[1].prompt_ids
    lp = log_softmax(full_forward(plain, ids)[0])  # (T, V)
    assert [t.id for t in got] == ids and got[0].logprob is None
    np.testing.assert_allclose([t.logprob for t in got[1:]],
                               [lp[j, t] for j, t in enumerate(ids[1:])], atol=1e-4)
    batch.release(runner)
    assert runner.pool.used == 0


def test_the_gathered_graph_gives_the_legacy_graphs_logits_for_each_pass(
        session: ort.InferenceSession, legacy_session: ort.InferenceSession,
        config: io.ArtifactConfig, plain: OrtDecoder,
        encode: Callable[[str], list[int]]) -> None:
    """engine.onnx computing only the wanted positions' logits gives what the graph of
    every position gives at those positions, and the plain loop's, for a batched prefill
    (last token only, and all for prompt logprobs), decode steps, an extend (all fed
    tokens) and the rest of a prompt after a reused prefix (its last token only)."""
    new, old = (EngineGraphRunner(s, config, PoolConfig(slots=4, prefix_block_size=4,
                                                        prefix_cache_blocks=32))
                for s in (session, legacy_session))
    prompts = [encode(PROMPTS[1]), encode(PROMPTS[2]), encode(PROMPTS[3])]
    for all_logits in (False, True):
        slots = {r: r.reserve(3) for r in (new, old)}
        got = {r: prefill(r, slots[r], [np.asarray(p) for p in prompts], all_logits)
               for r in (new, old)}
        for a, b, p in zip(got[new], got[old], prompts, strict=True):
            assert a.shape == b.shape == ((len(p) if all_logits else 1), new.vocab_size)
            np.testing.assert_allclose(a, b, atol=1e-5)
            np.testing.assert_allclose(a, full_forward(plain, p)[0][-len(a):], atol=1e-4)
        for r in (new, old):
            r.leave(slots[r], [])
    slots = {r: r.reserve(2) for r in (new, old)}
    seqs = [list(p) for p in prompts[:2]]
    for r in (new, old):
        prefill(r, slots[r], [np.asarray(p) for p in seqs])
    for step in range(3):
        nxt = np.asarray([11 + step, 40 + step], np.int64)  # (B,)
        for s, t in zip(seqs, nxt.tolist(), strict=True):
            s.append(t)
        a, b = (decode(r, slots[r], nxt) for r in (new, old))  # (B, V)
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, np.stack([full_forward(plain, s)[0][-1] for s in seqs]),
                                   atol=1e-4)
    more = encode(" my good lord")
    a, b = (extend(r, slots[r][0], np.asarray(more)) for r in (new, old))  # (k, V)
    assert a.shape == (len(more), new.vocab_size)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(a, full_forward(plain, seqs[0] + more)[0][-len(more):],
                               atol=1e-4)
    for r in (new, old):
        r.leave(slots[r], [])
    # The prompt again, its prefix cached: only the rest is fed (extend's last token).
    again = seqs[0] + more + encode(" and")
    ours = {r: r.reserve(1, prompts=[np.asarray(again)])[0] for r in (new, old)}
    assert new.prefix is not None and new.prefix.counters.hits > 0
    a, b = (extend(r, ours[r], np.asarray(again[r.cached_length(ours[r]):]), every=False)
            for r in (new, old))  # (1, V)
    assert a.shape == (1, new.vocab_size)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(a[0], full_forward(plain, again)[0][-1], atol=1e-4)


def test_a_chunk_riding_in_a_decode_step_equals_the_plain_loop(
        runner: PooledRunner, plain: OrtDecoder, encode: Callable[[str], list[int]]) -> None:
    """A step of decode rows and a prompt chunk (``run``): the decode rows' logits, the
    chunk's last logits and the chunk row's keys and values are those of the plain loop,
    whether the graph runs them in one pass (engine_mixed.onnx) or two."""
    prompts = [encode(PROMPTS[0]), encode(PROMPTS[2])]
    slots = runner.reserve(2)
    prefill(runner, slots, [np.asarray(p) for p in prompts])
    long = encode(PROMPTS[1] + " " + PROMPTS[3])
    (slot,) = runner.reserve(1, top=True)
    extend(runner, slot, np.asarray(long[:4]), every=False)  # a first chunk of its own
    seqs = [list(p) for p in prompts]
    fed = 4
    for size in (5, 3, len(long) - 12):  # the last chunk ends the prompt
        nxt = np.asarray([int(full_forward(plain, s)[0][-1].argmax()) for s in seqs])  # (B,)
        for s, t in zip(seqs, nxt, strict=True):
            s.append(int(t))
        result = runner.run(StepPlan((
            *(RowWork(s, np.asarray([t])) for s, t in zip(slots, nxt, strict=True)),
            RowWork(slot, np.asarray(long[fed:fed + size])))))
        logits, chunk = np.concatenate(result.outputs[:2]), result.outputs[2]
        assert len(result.passes) == (1 if runner.mixes_chunks else 2)
        fed += size
        want = np.stack([full_forward(plain, s)[0][-1] for s in seqs])  # (B, V)
        np.testing.assert_allclose(logits, want, atol=1e-4)
        np.testing.assert_allclose(chunk[0], full_forward(plain, long[:fed])[0][-1], atol=1e-4)
    assert fed == len(long)
    _, present = full_forward(plain, long)
    for mine, theirs in zip(runner.pool.arrays, present, strict=True):
        np.testing.assert_allclose(mine[slot.index, :, :len(long)], theirs, atol=1e-5)
    assert runner.pool.tokens[slot.index, :len(long)].tolist() == long
    assert [int(runner.pool.lengths[s.index]) for s in slots] == [len(s) for s in seqs]


def test_newcomers_prompts_riding_in_a_decode_step_equal_the_plain_loop(
        runner: PooledRunner, plain: OrtDecoder, encode: Callable[[str], list[int]]) -> None:
    """A step of two decode rows and two newcomers' whole prompts (ragged), one pass where
    the graph mixes them (``run``); logits and the newcomers' keys and values are the
    plain loop's."""
    prompts = [encode(PROMPTS[0]), encode(PROMPTS[2])]
    slots = runner.reserve(2)
    prefill(runner, slots, [np.asarray(p) for p in prompts])
    seqs = [list(p) for p in prompts]
    nxt = np.asarray([int(full_forward(plain, s)[0][-1].argmax()) for s in seqs])  # (B,)
    for s, t in zip(seqs, nxt, strict=True):
        s.append(int(t))
    newcomers = [encode(PROMPTS[3]), encode(PROMPTS[1])]
    fresh = runner.reserve(2)
    result = runner.run(StepPlan((
        *(RowWork(s, np.asarray([t])) for s, t in zip(slots, nxt, strict=True)),
        *(RowWork(s, np.asarray(p), first=True) for s, p in zip(fresh, newcomers,
                                                                  strict=True)))))
    logits, firsts = np.concatenate(result.outputs[:2]), result.outputs[2:]
    assert len(result.passes) == (1 if runner.mixes_chunks else 2)
    want = np.stack([full_forward(plain, s)[0][-1] for s in seqs])  # (B, V)
    np.testing.assert_allclose(logits, want, atol=1e-4)
    for got, p, slot in zip(firsts, newcomers, fresh, strict=True):
        ref, present = full_forward(plain, p)
        np.testing.assert_allclose(got[-1], ref[-1], atol=1e-4)
        assert runner.pool.lengths[slot.index] == len(p)
        for mine, theirs in zip(runner.pool.arrays, present, strict=True):
            np.testing.assert_allclose(mine[slot.index, :, :len(p)], theirs, atol=1e-5)
    assert [int(runner.pool.lengths[s.index]) for s in slots] == [len(s) for s in seqs]


@pytest.mark.parametrize("decoding", [False, True], ids=["idle", "beside decode rows"])
def test_newcomers_and_a_long_prompts_first_chunk_in_one_step_equal_the_plain_loop(
        runner: PooledRunner, plain: OrtDecoder, encode: Callable[[str], list[int]],
        decoding: bool) -> None:
    """The plan the scheduler makes when newcomers and a long prompt arrive together: the
    newcomers reserved as one run at the bottom of the pool, the long prompt at the top
    (``top``, away from them), all three rows into empty slots in one step, with or without
    running rows beside them. engine.onnx binds one run of slots a pass, so the packer
    makes the two runs two passes (once it put them in one, which raised); every row's
    logits and cached keys and values are the plain loop's."""
    running = [encode(PROMPTS[0])] if decoding else []
    slots = runner.reserve(len(running)) if decoding else []
    if decoding:
        prefill(runner, slots, [np.asarray(p) for p in running])
    newcomers = [encode(PROMPTS[3]), encode(PROMPTS[2])]
    fresh = runner.reserve(2)
    long = encode(PROMPTS[1] + " " + PROMPTS[3])
    (top,) = runner.reserve(1, top=True)
    assert top.index == runner.capacity - 1 and top.index > fresh[-1].index + 1
    nxt = [int(full_forward(plain, p)[0][-1].argmax()) for p in running]
    result = runner.run(StepPlan((
        *(RowWork(s, np.asarray([t])) for s, t in zip(slots, nxt, strict=True)),
        *(RowWork(s, np.asarray(p), first=True) for s, p in zip(fresh, newcomers,
                                                                  strict=True)),
        RowWork(top, np.asarray(long[:6]), first=True))))
    outputs = result.outputs
    for got, tokens in zip(outputs, [*([*p, t] for p, t in zip(running, nxt, strict=True)),
                                     *newcomers, long[:6]], strict=True):
        np.testing.assert_allclose(got[-1], full_forward(plain, tokens)[0][-1], atol=1e-4)
    for slot, tokens in zip([*fresh, top], [*newcomers, long[:6]], strict=True):
        _, present = full_forward(plain, tokens)
        assert runner.pool.lengths[slot.index] == len(tokens)
        for mine, theirs in zip(runner.pool.arrays, present, strict=True):
            np.testing.assert_allclose(mine[slot.index, :, :len(tokens)], theirs, atol=1e-5)
    assert sorted(i for p in result.passes for i in p.rows) == list(range(len(outputs)))


def test_a_newcomer_with_a_cached_prefix_rides_and_changes_no_logit(
        mixed_session: ort.InferenceSession, config: io.ArtifactConfig, plain: OrtDecoder,
        encode: Callable[[str], list[int]]) -> None:
    """With prefix caching on, a newcomer whose prompt starts with cached blocks takes its
    slot with them loaded (``reserve``) and feeds only its rest, riding in the decode
    step's pass; one without is prefilled in a pass of its own; all get the plain loop's
    logits."""
    runner = EngineGraphRunner(mixed_session, config, PoolConfig(
        slots=8, prefix_block_size=4, prefix_cache_blocks=32))
    shared = encode(PROMPTS[1] + " " + PROMPTS[3])
    (first,) = runner.reserve(1)
    prefill(runner, [first], [np.asarray(shared)])  # its blocks go to the prefix cache
    token = int(full_forward(plain, shared)[0][-1].argmax())
    newcomers = [shared[:-2] + encode(" lord"), encode(PROMPTS[0])]
    assert runner.prefix is not None
    hits = runner.prefix.counters.hits
    fresh = runner.reserve(2, prompts=[np.asarray(p) for p in newcomers])
    reused = runner.cached_length(fresh[0])
    assert runner.prefix.counters.hits > hits and reused > 0
    assert runner.cached_length(fresh[1]) == 0
    result = runner.run(StepPlan((RowWork(first, np.asarray([token])),
                                  RowWork(fresh[0], np.asarray(newcomers[0][reused:])),
                                  RowWork(fresh[1], np.asarray(newcomers[1]), first=True))))
    assert sorted(p.rows for p in result.passes) == [(0, 1), (2,)]
    np.testing.assert_allclose(result.outputs[0][0],
                               full_forward(plain, [*shared, token])[0][-1], atol=1e-4)
    for got, p in zip(result.outputs[1:], newcomers, strict=True):
        np.testing.assert_allclose(got[-1], full_forward(plain, p)[0][-1], atol=1e-4)


def test_steady_decode_with_the_cache_left_in_ort_settles_into_the_pool(
        model_session: ort.InferenceSession, config: io.ArtifactConfig, plain: OrtDecoder,
        encode: Callable[[str], list[int]]) -> None:
    """model.onnx as it runs under CUDA: a steady batch binds each step's presents as the
    next past and leaves the pool behind; ``settle`` (and any other call, here a leave)
    writes the pending columns, so the pool ends equal to the plain loop's cache, and
    the batch decodes on from it."""
    runner = ModelGraphRunner(model_session, config, PoolConfig(slots=8), resident=True)
    seqs = [encode(p) for p in PROMPTS[:3]]  # ragged: left padding in the carried past
    slots = runner.reserve(3)
    prefill(runner, slots, [np.asarray(s) for s in seqs])

    def step(rows: list[int]) -> None:
        nxt = np.asarray([int(full_forward(plain, seqs[r])[0][-1].argmax()) for r in rows])
        got = decode(runner, [slots[r] for r in rows], nxt)  # (B, V)
        for r, t in zip(rows, nxt.tolist(), strict=True):
            seqs[r].append(t)
        want = np.stack([full_forward(plain, seqs[r])[0][-1] for r in rows])
        np.testing.assert_allclose(got, want, atol=1e-4)

    def assert_pool_is_the_plain_cache(rows: list[int]) -> None:
        for r in rows:
            n = len(seqs[r])
            assert runner.pool.lengths[slots[r].index] == n
            _, present = full_forward(plain, seqs[r])
            for mine, theirs in zip(runner.pool.arrays, present, strict=True):
                np.testing.assert_allclose(mine[slots[r].index, :, :n], theirs, atol=1e-5)

    for _ in range(5):
        step([0, 1, 2])
    before = [a[slots[0].index, :, len(seqs[0]) - 1].copy() for a in runner.pool.arrays]
    runner.settle()
    assert_pool_is_the_plain_cache([0, 1, 2])
    assert any(not np.array_equal(b, a[slots[0].index, :, len(seqs[0]) - 1])
               for b, a in zip(before, runner.pool.arrays, strict=True))  # it was pending
    for _ in range(3):
        step([0, 1, 2])
    kept = runner.leave(slots, [0, 2])  # settles first: row 1's cache goes out whole
    assert [s.index for s in kept] == [slots[0].index, slots[2].index]
    assert_pool_is_the_plain_cache([0, 2])
    for _ in range(3):
        step([0, 2])
    runner.settle()
    assert_pool_is_the_plain_cache([0, 2])
