"""The engine graphs against PyTorch by parity.py's rule (:func:`verify_engine`), and
behind model.onnx's decoder call (:class:`EngineDecoder`) for the checks written for it
(export/quantize/weights.py's figures, layerwise.py's continuations). Both bind each
layer's key/value buffer as its past and its present (:func:`_run_in_place`): the kernel
writes in place, as into the service's KV pool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from export.verify.parity import (
    DECODE_LENGTHS,
    DECODE_STEPS,
    DecodeParity,
    TorchReference,
    check_session,
    clear_mismatches,
    logits_tolerance,
    random_prompts,
    steps_within_context,
)
from model.gpt import GPT
from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.contract.graphs import GraphInterface

CAPACITY = 256  # positions of EngineDecoder's first buffers, grown when a pass needs more


def _idle_inputs(session: Any, cfg: Any, dtype: io.KvDtype = "float32") -> dict[str, np.ndarray]:
    """A mixed graph's second group feeding no token (``engine_spec.idle_chunk_inputs``)."""
    names = {i.name for i in session.get_inputs()}
    return es.idle_chunk_inputs(names, cfg.n_layers, cfg.kv_heads, cfg.head_dim, dtype)


def _run_in_place(session: Any, feed: dict[str, np.ndarray], caches: list[Any],
                  idle: dict[str, np.ndarray], extra: list[str] | None = None) -> list[Any]:
    """One engine.onnx pass: ``feed`` (``engine_spec.engine_feed``'s) and ``idle``
    (:func:`_idle_inputs`) as inputs, each of ``caches`` (OrtValues, in ``io.past_names``'
    order) bound as both its layer's past and its present. Returns the outputs: logits,
    the presents, the idle group's (to ignore), then ``extra``."""
    n = len(caches) // 2  # a key and a value a layer
    binding = session.io_binding()
    binding.bind_output(io.LOGITS, "cpu")
    for name, value in {**feed, **idle}.items():
        binding.bind_cpu_input(name, value)
    for past, present, cache in zip(io.past_names(n), io.present_names(n), caches, strict=True):
        binding.bind_ortvalue_input(past, cache)
        binding.bind_ortvalue_output(present, cache)
    ignored = [es.chunk_name(o) for o in (io.LOGITS, *io.present_names(n))] if idle else []
    for name in [*ignored, *(extra or [])]:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    return list(binding.get_outputs())


def verify_engine(gpt: GPT, path: Path, steps: int = DECODE_STEPS,
                  prompts: list[list[int]] | None = None,
                  reference: TorchReference | None = None,
                  dtype: io.KvDtype = "float32", threads: int = 1) -> dict[str, object]:
    """Greedy-decode ragged rows through engine.onnx, teacher-forced with PyTorch's tokens;
    logits within tolerance, greedy choices equal wherever PyTorch's choice is clear.
    ``dtype``: the graph's cache (and, float16, its arithmetic: the bound of
    :func:`logits_tolerance` for it); a float16 graph's ``greedy_ids`` must equal the
    argmax of its own logits.

    Pass model.onnx's ``reference`` and decode ``prompts`` and PyTorch runs no more.
    Also checks that the presents come back in the very buffers bound as pasts, i.e. that
    ONNX Runtime really updated the cache in place.
    """
    import onnxruntime as ort

    cfg = gpt.config
    if prompts is None:
        prompts = random_prompts(np.random.default_rng(0), cfg.vocab_size, list(DECODE_LENGTHS))
    steps = steps_within_context(cfg, prompts, steps)
    forced = (reference or TorchReference(gpt)).continuations(prompts, steps)
    session = check_session(path, threads)
    idle = _idle_inputs(session, cfg, dtype)
    lens = forced.lengths
    # as long as the check needs: GroupQueryAttention reads each row's first seqlens_k + 1
    # positions whatever the buffer's length, and max_seq_len ones cost SmolLM2 (8,192
    # positions) 750 MB
    length = min(cfg.max_seq_len, max(lens) + steps)
    shape = (len(lens), cfg.kv_heads, length, cfg.head_dim)
    caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.dtype(dtype)))
              for _ in range(2 * cfg.n_layers)]
    greedy = GraphInterface.of_session(session).greedy_ids  # a float16 graph's
    extra = [es.GREEDY_IDS, *([es.chunk_name(es.GREEDY_IDS)] if idle else [])] if greedy else []
    greedy_equal = True  # greedy_ids == argmax(logits), every row and step
    t = max(lens)
    ids = np.zeros((len(lens), t), np.int64)  # right-padded: each row's cache starts at 0
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    pos = np.tile(np.arange(t, dtype=np.int64), (len(lens), 1))
    total = np.asarray(lens, np.int64)
    parity, in_place, scale = DecodeParity(), True, 0.0
    for step in range(steps):
        last_fed = total - 1 if step == 0 else np.zeros_like(total)  # (B,) prompt end, then 0
        feed = es.engine_feed(ids, pos, total - 1, t if step == 0 else int(total.max()),
                              last_fed[:, None])  # logits (B, 1)
        outs = _run_in_place(session, feed, caches, idle, extra)
        in_place &= all(o.data_ptr() == c.data_ptr()
                        for o, c in zip(outs[1:1 + len(caches)], caches, strict=True))
        last = outs[0].numpy()[:, 0]  # (B, V)
        if greedy:
            ids_out = outs[-len(extra)].numpy()[:, 0]  # (B,)
            greedy_equal &= bool((ids_out == last.argmax(-1)).all())
        ref = forced.expected(step)  # (B, V)
        parity.add(last, ref)
        scale = max(scale, float(np.abs(ref).max()))
        ids, pos = forced.fed(step)[:, None], total[:, None].copy()  # PyTorch's tokens
        total = total + 1
    tolerance = logits_tolerance(cfg, scale, dtype, half=dtype == "float16")
    margins = parity.margins
    decided = clear_mismatches(margins, tolerance)
    result: dict[str, object] = {"steps": steps, "max_abs_diff": parity.worst,
                                 "greedy_equal": not decided,
                                 "near_ties": len(margins) - len(decided), "in_place": in_place,
                                 "tolerance": tolerance, "prompt_lengths": lens}
    if greedy:
        result["greedy_ids_equal_argmax"] = greedy_equal
    if not (parity.worst <= tolerance and not decided and in_place and greedy_equal):
        raise ValueError(f"engine.onnx disagrees with PyTorch: {result}")
    return result


def verify_engines(gpt: GPT, paths: dict[str, Path], verification: dict[str, Any],
                   reference: TorchReference | None, say: Callable[[str], None],
                   dtype: io.KvDtype = "float32", threads: int = 1) -> None:
    """:func:`verify_engine` of each engine graph (``paths``: its key in ``verification``
    → its file), fed model.onnx's decode prompts (``verification``'s)."""
    for key, path in paths.items():
        checked = verification[key] = verify_engine(
            gpt, path, prompts=verification["decode"]["prompts"], reference=reference,
            dtype=dtype, threads=threads)
        say(f"verified {path.name}: {checked['max_abs_diff']:.2e} over "
            f"{checked['steps']} steps, cache updated in place")


class EngineDecoder:
    """engine.onnx behind OrtDecoder's call shape (service/contract/reference.py).

    The past is opaque here: (B, nkv, length, hs) buffers of the graph's cache type (key/value
    heads, as the service's KV pool holds them) and each row's length. A pass's new tokens may be
    right-padded (the mask's zeros at the end of a row), each row's cache then holding its
    own length; every fed position gets its logits. The buffers are updated in place and
    hold ``CAPACITY`` positions, grown when a pass needs more, never to more than
    ``max_seq_len``: GroupQueryAttention reads each row's first ``seqlens_k + 1`` positions
    whatever the buffer's length, and ``max_seq_len`` ones fed back through ``run`` cost a
    SmolLM2 export 12 GB and 95 s (docs/export.md).
    """

    def __init__(self, path: Path, gpt: GPT, threads: int = 1) -> None:
        self.session = check_session(path, threads)
        self.config = gpt.config
        self.capacity = min(CAPACITY, gpt.config.max_seq_len)
        interface = GraphInterface.of_session(self.session)
        self._gathers = interface.gathers_logits
        self._cache = interface.kv_dtype or "float32"  # the pool's type
        self._idle = _idle_inputs(self.session, gpt.config, self._cache)

    def empty_past(self, batch: int) -> tuple[list[np.ndarray], np.ndarray]:
        cfg = self.config
        shape = (batch, cfg.kv_heads, self.capacity, cfg.head_dim)  # (B, nkv, L, hs)
        zeros = [np.zeros(shape, self._cache) for _ in range(2 * cfg.n_layers)]
        return zeros, np.zeros(batch, np.int64)

    def _room(self, buffers: list[np.ndarray], total: int) -> list[np.ndarray]:
        """``buffers``, or copies of them long enough for ``total`` positions."""
        length = buffers[0].shape[2]
        if total <= length:
            return buffers
        if total > self.config.max_seq_len:
            raise ValueError(f"{total} positions exceed max_seq_len {self.config.max_seq_len}")
        length = min(self.config.max_seq_len, max(total, 2 * length))
        grown = []
        for buffer in buffers:
            wider = np.zeros((*buffer.shape[:2], length, buffer.shape[3]), buffer.dtype)
            wider[:, :, :buffer.shape[2]] = buffer
            grown.append(wider)
        return grown

    def __call__(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                 past: tuple[list[np.ndarray], np.ndarray]
                 ) -> tuple[np.ndarray, tuple[list[np.ndarray], np.ndarray]]:
        import onnxruntime as ort

        buffers, lengths = past
        width = ids.shape[1]
        fed = mask[:, -width:].sum(1)  # (B,) this pass's tokens of each row
        if not (mask[:, -width:] == (np.arange(width)[None] < fed[:, None])).all():
            raise ValueError("EngineDecoder takes rows whose new tokens are right-padded at "
                             "most")
        total = lengths + fed  # (B,)
        reach = int((lengths + width).max())  # the padding's keys and values are written too
        buffers = self._room(buffers, reach)
        every = np.tile(np.arange(width, dtype=np.int64), (len(ids), 1))  # (B, T)
        feed = es.engine_feed(ids, pos, total - 1, reach,  # every position's logits
                              every if self._gathers else None)
        caches = [ort.OrtValue.ortvalue_from_numpy(b) for b in buffers]  # the buffers' memory
        logits = _run_in_place(self.session, feed, caches, self._idle)[0].numpy()
        return logits, (buffers, total)  # logits (B, T, V)
