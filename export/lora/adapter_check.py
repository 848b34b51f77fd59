"""Checking an adapter graph (export/lora/adapter_graph.py): rows under an adapter and base rows
in one pass, against PyTorch with the adapter applied and against the base graph.

A random rank-4 adapter on every target sits in slot 2 of S = 2 slots (slot 1 holds
another, which no row uses: the mask must keep it out); a base row and two adapted rows
run in one prefill pass, both row groups fed where the graph has two. Base rows must
equal the base graph's (within :data:`BASE_TOL`: the same products, and an added zero),
adapted rows PyTorch's logits by the float32 rule (export/verify/parity.py). PyTorch's side is
computed by :meth:`AdapterReference.of` while its weights are here, with the adapter wired
beside the frozen layers (model/finetune/lora.py: the merged model's arithmetic, without a
copy of its weights); where there is no PyTorch model (the GGUF path, a quantised graph)
the adapted rows must only move away from the base ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.lora.adapter_graph import target_widths
from export.verify.parity import attention_tolerance, check_session, logits_tolerance
from model.architectures import architecture
from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.contract.adapter_spec import LORA_MASK, LORA_SUFFIX, lora_a, lora_b
from service.contract.graphs import GraphInterface

RANK, SLOTS, SLOT = 4, 2, 1  # the checked adapter: rank 4, in slot 2 (index 1) of 2
ALPHA = 8.0
SEED = 0  # the checked adapter's (drawn_inputs)
BASE_TOL = 1e-5  # a base row against the base graph: the same products plus zero
PROMPT_TOKENS = 6
CHECK_SUFFIX = ".check"  # the adapter graphs of the float32 graphs, until checked
# one module's (A (r, in), B (out, r)) and its scale, by transformers' module name
Lora = dict[str, tuple[np.ndarray, np.ndarray]]


def random_adapter(cfg: Any, seed: int, rank: int = RANK) -> Lora:
    """A rank-``rank`` adapter on every target: A as PEFT draws it, B non-zero (a trained
    one's size: its update moves the logits, within the float32 rule's reach)."""
    rng = np.random.default_rng(seed)
    out: Lora = {}
    for target in architecture(cfg.arch).lora_targets(cfg):
        width_in, width_out = target_widths(target, cfg)
        a = rng.uniform(-1, 1, (rank, width_in)) / np.sqrt(width_in)  # (r, in)
        b = rng.normal(0.0, 0.05, (width_out, rank))  # (out, r)
        out[target.module] = (a.astype(np.float32), b.astype(np.float32))
    return out


def drawn_inputs(cfg: Any) -> tuple[np.ndarray, Lora, Lora]:
    """The check's two prompts (2, T), its adapter and the idle slot's, from ``SEED``."""
    rng = np.random.default_rng(SEED + 1)
    prompts = rng.integers(0, cfg.vocab_size, (2, PROMPT_TOKENS)).astype(np.int64)
    return prompts, random_adapter(cfg, SEED), random_adapter(cfg, SEED + 2)


def slot_inputs(cfg: Any, slots: list[Lora | None]) -> dict[str, np.ndarray]:
    """Every module's A (S·R, in) and B (S·R, out) for these slots (None: empty, zeros) of
    R = ``RANK`` rows, B transposed and scaled by ALPHA / r, as adapter_spec.py lays them
    out."""
    feed: dict[str, np.ndarray] = {}
    for target in architecture(cfg.arch).lora_targets(cfg):
        width_in, width_out = target_widths(target, cfg)
        a = np.zeros((len(slots) * RANK, width_in), np.float32)
        b = np.zeros((len(slots) * RANK, width_out), np.float32)
        for s, lora in enumerate(slots):
            if lora is not None and target.module in lora:
                la, lb = lora[target.module]
                r = la.shape[0]
                a[s * RANK:s * RANK + r] = la
                b[s * RANK:s * RANK + r] = lb.T * (ALPHA / r)
        feed[lora_a(target.module)], feed[lora_b(target.module)] = a, b
    return feed


def token_mask(slot_of_token: list[int | None], slots: int) -> np.ndarray:
    """lora_mask (N, S·R): ones in each token's slot's R columns; a base token all 0."""
    mask = np.zeros((len(slot_of_token), slots * RANK), np.float32)
    for n, s in enumerate(slot_of_token):
        if s is not None:
            mask[n, s * RANK:(s + 1) * RANK] = 1.0
    return mask


def torch_adapter(cfg: Any, lora: Lora) -> Any:
    """``lora`` as model/finetune/lora.py's Adapter (to wire, or to merge)."""
    from model.finetune.lora import Adapter, LoRA, LoRASettings

    loras = []
    for target in architecture(cfg.arch).lora_targets(cfg):
        a, b = lora[target.module]
        module = LoRA(target, a.shape[1], b.shape[0], a.shape[0], ALPHA / a.shape[0], 0.0)
        with torch.no_grad():
            module.lora_A.copy_(torch.from_numpy(a))
            module.lora_B.copy_(torch.from_numpy(b))
        loras.append(module)
    return Adapter(loras, LoRASettings(rank=RANK, alpha=ALPHA, dropout=0.0))


@dataclass
class AdapterReference:
    """PyTorch's logits (2, T, V) of two prompts, and attention weights of the second,
    under the checked adapter (slot 2): computed before the weights are dropped."""

    adapter: Lora
    idle: Lora  # slot 1's: in the buffers, used by no row
    prompts: np.ndarray  # (2, T)
    logits: np.ndarray  # (2, T, V)
    weights: list[np.ndarray]  # per layer (1, nh, T, T)
    qk_scale: float

    @classmethod
    @torch.no_grad()
    def of(cls, gpt: Any) -> AdapterReference:
        from model.finetune.lora import AdaptedLinear, wire

        cfg = gpt.config
        prompts, adapter, idle = drawn_inputs(cfg)
        wired = torch_adapter(cfg, adapter)
        wire(gpt, wired)
        try:
            logits = gpt(torch.from_numpy(prompts)).logits.float().numpy()
            out = gpt(torch.from_numpy(prompts[1:]), return_intermediates=True)
        finally:  # the frozen layers back, as they were
            for lora in wired.each():
                for name in lora.target.ours:
                    parent, _, child = name.rpartition(".")
                    layer = gpt.get_submodule(name)
                    if isinstance(layer, AdaptedLinear):
                        setattr(gpt.get_submodule(parent), child, layer.base)
        weights = [inter.weights.numpy() for inter in out.intermediates]
        qk = max(float((i.q.norm(dim=-1).amax(-1) * i.k.norm(dim=-1).amax(-1)).max())
                 for i in out.intermediates) / cfg.head_dim ** 0.5
        return cls(adapter, idle, prompts, logits, weights, qk)


def prefill(session: Any, cfg: Any, groups: list[np.ndarray],
             extra: dict[str, np.ndarray]) -> list[np.ndarray]:
    """One prefill pass from empty caches, one (B, T) block of ids per row group; each
    group's logits (B, T, V) at every position."""
    feed = dict(extra)
    outputs = []
    cache = GraphInterface.of_session(session).kv_dtype or "float32"
    for g, ids in enumerate(groups):
        prefix = es.CHUNK_PREFIX if g else ""
        b, t = ids.shape
        every = np.tile(np.arange(t, dtype=np.int64), (b, 1))
        feed.update(es.engine_feed(ids, every, np.full(b, t - 1), t, every, prefix))
        zeros = np.zeros((b, cfg.kv_heads, t, cfg.head_dim), cache)
        feed.update({prefix + name: zeros for name in io.past_names(cfg.n_layers)})
        outputs.append(prefix + io.LOGITS)
    return list(session.run(outputs, feed))


def check_engine_adapter(lora_path: Path, base_path: Path, cfg: Any,
                         reference: AdapterReference | None, threads: int = 1
                         ) -> dict[str, Any]:
    """An engine adapter graph against its base graph and (given) PyTorch; the manifest's
    figures. Raises ValueError where a row disagrees."""
    prompts, adapter, idle = drawn_inputs(cfg) if reference is None else (
        reference.prompts, reference.adapter, reference.idle)
    # rows: prompt 0 as base, prompt 1 and prompt 0 under slot 2 (the last: the chunk group)
    rows = np.stack([prompts[0], prompts[1], prompts[0]])  # (3, T)
    base = check_session(base_path, threads)  # one session at a time: each holds the weights
    mixed = es.chunk_name(io.INPUT_IDS) in {i.name for i in base.get_inputs()}
    groups = [rows[:2], rows[2:]] if mixed else [rows]
    t = rows.shape[1]
    slot_of = [None] * t + [SLOT] * (2 * t)  # the pass's tokens, row-major, group by group
    buffers = slot_inputs(cfg, [idle, adapter])
    plain = np.concatenate(prefill(base, cfg, groups, {}))  # (3, T, V)
    del base
    lora = check_session(lora_path, threads)
    got = np.concatenate(prefill(lora, cfg, groups, {
        **buffers, LORA_MASK: token_mask(slot_of, SLOTS)}))
    zero_mask = np.concatenate(prefill(lora, cfg, groups, {
        **buffers, LORA_MASK: token_mask([None] * len(slot_of), SLOTS)}))
    figures: dict[str, Any] = {
        "rows": "1 base, 2 under a rank-4 adapter in slot 2 of 2" + (
            " (one in each row group)" if mixed else ""),
        "base_rows_max_abs_diff": float(np.abs(got[0] - plain[0]).max()),
        "zero_mask_max_abs_diff": float(np.abs(zero_mask - plain).max()),
        "adapted_rows_moved": float(np.abs(got[1:] - plain[1:]).max())}
    problems = [f"{key} {figures[key]:.3g} > {BASE_TOL}"
                for key in ("base_rows_max_abs_diff", "zero_mask_max_abs_diff")
                if not figures[key] <= BASE_TOL]
    if reference is not None:
        ref = reference.logits[[1, 0]]  # rows 1 and 2: prompts 1 and 0
        tolerance = logits_tolerance(cfg, float(np.abs(ref).max()))
        figures.update(max_abs_diff=float(np.abs(got[1:] - ref).max()), tolerance=tolerance,
                       reference="PyTorch with the adapter applied")
        if not figures["max_abs_diff"] <= tolerance:
            problems.append(f"adapted rows differ from PyTorch's by "
                            f"{figures['max_abs_diff']:.3g} > {tolerance:.3g}")
    else:
        figures["reference"] = "the base graph only (no float32 PyTorch model here)"
    if not figures["adapted_rows_moved"] > BASE_TOL:
        problems.append("adapted rows equal the base rows: the update is not wired in")
    if problems:
        raise ValueError(f"{lora_path.name} disagrees: {'; '.join(problems)}")
    return figures


def check_attention_adapter(lora_path: Path, cfg: Any, reference: AdapterReference
                            ) -> dict[str, Any]:
    """attention_lora.onnx's weights for prompt 1 under slot 2 against PyTorch's."""
    session = check_session(lora_path)
    ids = reference.prompts[1:]  # (1, T)
    t = ids.shape[1]
    names = [io.attention_output_name(i, "weights") for i in range(cfg.n_layers)]
    outs = session.run(names, {
        io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
        io.POSITION_IDS: np.arange(t, dtype=np.int64)[None],
        **slot_inputs(cfg, [reference.idle, reference.adapter]),
        LORA_MASK: token_mask([SLOT] * t, SLOTS)})
    worst = max(float(np.abs(got - ref).max())
                for got, ref in zip(outs, reference.weights, strict=True))
    tolerance = attention_tolerance(cfg, reference.qk_scale)
    if not worst <= tolerance:
        raise ValueError(f"{lora_path.name}: attention weights under an adapter differ from "
                         f"PyTorch's by {worst:.3g} > {tolerance:.3g}")
    return {"weights_max_abs_diff": worst, "tolerance": tolerance}


def verify_adapter_graphs(directory: Path, cfg: Any, reference: AdapterReference
                          ) -> dict[str, Any]:
    """The adapter graphs of the float32 graphs in ``directory`` (the mixed engine graph,
    else engine.onnx, and attention.onnx) against PyTorch, written as check copies and
    removed; the manifest's figures, or why there are none (a family or dtype without
    them). Raises ValueError where a graph disagrees."""
    from export.lora.adapter_graph import write_adapter_graphs
    from service.contract.adapter_spec import lora_file

    engine = next((name for name in (es.ENGINE_MIXED_FILE, es.ENGINE_FILE)
                   if (directory / name).is_file()), None)
    files = [*([engine] if engine else []), io.ATTENTION_FILE]
    try:
        written = write_adapter_graphs(directory, cfg, files, CHECK_SUFFIX)
    except ValueError as exc:
        return {"skipped": str(exc)}
    try:
        figures: dict[str, Any] = {}
        if engine:
            figures[lora_file(engine)] = check_engine_adapter(
                directory / f"{lora_file(engine)}{CHECK_SUFFIX}", directory / engine, cfg,
                reference)
        figures[lora_file(io.ATTENTION_FILE)] = check_attention_adapter(
            directory / f"{lora_file(io.ATTENTION_FILE)}{CHECK_SUFFIX}", cfg, reference)
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    return figures


def write_served_adapter_graphs(directory: Path, cfg: Any, check: bool, say: Any,
                                threads: int = 1) -> dict[str, Any]:
    """``<stem>_lora.onnx`` beside each final graph in ``directory``; with ``check``, the
    mixed (else plain) engine one's base rows against its base graph and its adapted rows
    moved (the served graphs after quantisation, which PyTorch's float32 logits do not
    bound). The figures, or why no adapter graph was written."""
    from export.lora.adapter_graph import write_adapter_graphs
    from service.contract.adapter_spec import lora_file

    try:
        written = write_adapter_graphs(directory, cfg)
    except ValueError as exc:
        say(f"{exc}: the artifact serves no adapters")
        return {"skipped": str(exc)}
    figures: dict[str, Any] = {"files": [p.name for p in written]}
    # one engine graph checked (the mixed one where there): the other's rewrite is the same
    engine = [p for p in written if p.name != lora_file(io.ATTENTION_FILE)]
    for path in engine[-1:] if check else []:
        base = path.with_name(path.name.replace(LORA_SUFFIX, ""))
        figures[path.name] = check_engine_adapter(path, base, cfg, None, threads=threads)
    say(f"wrote {', '.join(figures['files'])}")
    return figures
