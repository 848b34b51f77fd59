"""Turn one benchmark run into targets (PASS/MISS), a Markdown table and a PNG chart.

Every figure is set beside transformers ``generate`` (engine 3) at the same batch size;
HTTP rows at concurrency c are set beside batch c.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

LABELS = {
    "torch_nocache": "1 PyTorch eager, no KV cache",
    "torch_kv": "2 PyTorch eager, KV cache",
    "hf_generate": "3 transformers generate",
    "ort_plain": "3b plain ONNX Runtime loop",
    "optimum": "3b Optimum ORTModelForCausalLM",
    "engine": "4 our engine (fp32)",
    "engine_int8": "5 our engine (int8)",
    "engine_int4": "5 our engine (int4)",
    "engine_gguf": "5 our engine (GGUF blocks)",
    "http": "6 HTTP service",
    "ct2": "7 CTranslate2 (fp32)",
    "ct2_int8": "7 CTranslate2 (int8)",
    "llamacpp_f32": "8 llama.cpp (f32 GGUF)",
    "llamacpp_q8_0": "8 llama.cpp (q8_0 GGUF)",
    "llamacpp_q4_1": "8 llama.cpp (shipped Q4_1 GGUF)",
}
# Bytes of weights one decode step reads, per parameter, for the bandwidth bound.
WEIGHT_BYTES = {"engine": 4.0, "llamacpp_f32": 4.0, "ct2": 4.0, "hf_generate": 4.0,
                "engine_int8": 1.0 + 4.0 / 32, "llamacpp_q8_0": 1.0 + 2.0 / 32,
                "ct2_int8": 1.0, "engine_int4": 0.5 + 4.5 / 32,
                "llamacpp_q4_1": 0.5 + 4.0 / 32}
BASELINE = "hf_generate"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def pair_ratio(rows: list[dict[str, Any]], a: str, b: str, batch: int) -> float | None:
    """Engine a's tokens/s ÷ engine b's at one batch size. Rows measured in the same rounds
    (``--rounds``) give the median of the per-round ratios, so a machine that drifts
    between rounds moves both sides of each ratio alike."""
    row_a, row_b = _row(rows, a, batch), _row(rows, b, batch)
    ra, rb = row_a.get("tokens_per_s_rounds"), row_b.get("tokens_per_s_rounds")
    if ra and rb and len(ra) == len(rb) and None not in ra and None not in rb and all(rb):
        return statistics.median(x / y for x, y in zip(ra, rb, strict=True))
    return _ratio(row_a.get("tokens_per_s"), row_b.get("tokens_per_s"))


def flat_rows(preset: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured row of a preset, with its ratios to transformers at that batch."""
    rows: list[dict[str, Any]] = []
    engines = preset.get("engines", {})
    for name, res in engines.items():
        for row in res.get("rows", []):
            rows.append({"engine": name, **row, "peak_rss_mb": res.get("memory", {}).get(
                "peak_mb")})
    http = preset.get("http", {})
    for row in http.get("rows", []):
        rows.append({"engine": "http", "batch": row["concurrency"], **row,
                     "ttft_ms": http.get("ttft_ms") if row["concurrency"] == 1 else None,
                     "peak_rss_mb": http.get("peak_rss_mb")})
    base = {r["batch"]: r for r in rows if r["engine"] == BASELINE}
    for r in rows:
        ref = base.get(r["batch"], {})
        r["x_tokens_per_s"] = _ratio(r.get("tokens_per_s"), ref.get("tokens_per_s"))
        r["x_ttft"] = _ratio(r.get("ttft_ms"), ref.get("ttft_ms"))
        r["x_latency_p50"] = _ratio(r.get("latency_p50_ms"), ref.get("latency_p50_ms"))
        r["x_peak_rss"] = _ratio(r.get("peak_rss_mb"), ref.get("peak_rss_mb"))
    return rows


def _row(rows: list[dict[str, Any]], engine: str, batch: int) -> dict[str, Any]:
    """The engine's row at that batch size ({} when it was not measured)."""
    return next((r for r in rows if r["engine"] == engine and r["batch"] == batch), {})


def _get(rows: list[dict[str, Any]], engine: str, batch: int, key: str) -> float | None:
    value = _row(rows, engine, batch).get(key)
    return float(value) if value is not None else None


def _check(name: str, value: float | None, target: float, higher: bool, unit: str,
           why_missing: str) -> dict[str, Any]:
    if value is None:
        return {"target": name, "status": "NOT MEASURED", "value": None, "detail": why_missing}
    ok = value >= target if higher else value <= target
    op = "≥" if higher else "≤"
    return {"target": name, "status": "PASS" if ok else "MISS", "value": value,
            "detail": f"{value:.3g}{unit} (target {op} {target:g}{unit})"}


def bandwidth_fractions(preset: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, float]:
    """Batch-1 decode as a fraction of the memory-bandwidth bound, per engine.

    Each decode step streams every weight once, so tokens/s can be at most read
    bandwidth ÷ weight bytes; the fraction is weight bytes × decode tok/s ÷ bandwidth.
    int8 weight bytes include the scales (one fp32 per 32 for MatMulNBits, one fp16 per
    32 for q8_0); embeddings and norms are counted at the same width, an approximation.
    """
    bw = ceiling.get("read_bandwidth_gbs_best")
    out: dict[str, float] = {}
    for r in flat_rows(preset):
        per = WEIGHT_BYTES.get(r["engine"])
        tps = r.get("decode_tokens_per_s")
        if r["batch"] == 1 and per and tps and bw:
            out[r["engine"]] = preset["params"] * per * tps / (bw * 1e9)
    return out


# Issue 10 (gpt2) and issue 14 (smollm2-135m): (ours, peer, batch or None = the largest,
# minimum ratio of tokens/s) within one run.
PEER_CHECKS: dict[str, list[tuple[str, str, int | None, float]]] = {
    "gpt2": [("engine", "llamacpp_f32", 1, 1.2), ("engine", "ct2", 1, 1.3),
             ("engine", "ct2", None, 1.5), ("engine", BASELINE, 1, 3.0),
             ("engine", BASELINE, None, 2.0), ("engine_int8", "llamacpp_q8_0", 1, 1.0)],
    "smollm2-135m": [("engine", "ct2", 1, 1.2), ("engine", BASELINE, 1, 3.0),
                     ("engine", "ct2", None, 1.5), ("engine", BASELINE, None, 2.0),
                     ("engine_int8", "engine", 1, 1.5)],
    # Issue 20: the real model, llama.cpp on the very same file.
    "smollm2-135m-instruct": [
        ("engine_int4", "llamacpp_q4_1", 1, 1.2), ("engine_int4", "llamacpp_q4_1", 32, 2.0),
        ("engine_gguf", "llamacpp_q4_1", 1, 1.2), ("engine_gguf", "llamacpp_q4_1", 32, 2.0),
        ("engine_int8", "llamacpp_q8_0", 1, 1.2), ("engine", "llamacpp_f32", 1, 1.1),
        *((q, "engine", b, 1.0) for q in ("engine_int4", "engine_int8", "engine_gguf")
          for b in (1, 8, 32))],
}


def peer_targets(preset: dict[str, Any], ceiling: dict[str, Any],
                 name: str) -> list[dict[str, Any]]:
    """The imported presets' targets: ratios to the peers within this one run, the batch-1
    share of the memory-bandwidth bound, and int8 agreement."""
    rows = flat_rows(preset)
    big = max((r["batch"] for r in rows if r["engine"] == "engine"), default=32)
    out = []
    for a, b, batch, target in PEER_CHECKS[name]:
        n = batch or big
        out.append(_check(f"{LABELS[a]} vs {LABELS[b]}, batch {n}",
                          pair_ratio(rows, a, b, n), target, True, "×",
                          f"needs the {a} and {b} rows"))
    fractions = bandwidth_fractions(preset, ceiling)
    preset["bandwidth_fraction_batch1"] = fractions
    frac = fractions.get("engine")
    out.append(_check("batch-1 fp32 decode share of the memory-bandwidth bound",
                      frac * 100 if frac is not None else None, 50.0, True, "%",
                      "needs the engine row and the ceiling"))
    agree = preset.get("int8_agreement", {}).get("token_agreement")
    weights = ("real weights" if name == "smollm2-135m-instruct" else
               "random weights: see the export figure on trained weights in the README")
    out.append(_check(f"int8 greedy agreement ({weights})",
                      agree * 100 if agree is not None else None, 97.0, True, "%",
                      preset.get("int8_agreement", {}).get("error", "not run")))
    return out


def evaluate_targets(preset: dict[str, Any], ceiling: dict[str, Any],
                     name: str = "") -> list[dict[str, Any]]:
    if name in PEER_CHECKS:
        return peer_targets(preset, ceiling, name)
    rows = flat_rows(preset)
    big = max((r["batch"] for r in rows if r["engine"] == "engine"), default=32)

    def ratio(a: str, b: str, batch: int) -> float | None:
        return pair_ratio(rows, a, b, batch)

    out = [
        _check("engine vs transformers, batch 1", ratio("engine", BASELINE, 1), 2.0, True, "×",
               "needs both the engine and transformers rows"),
        _check(f"engine vs transformers, batch {big}", ratio("engine", BASELINE, big), 1.5,
               True, "×", "needs both rows"),
    ]
    for other, label in (("ort_plain", "plain ORT loop"), ("optimum", "Optimum")):
        for b in (1, big):
            out.append(_check(f"engine vs {label}, batch {b}", ratio("engine", other, b), 1.2,
                              True, "×", f"needs the engine and {label} rows"))
    out.append(_check("64-token prefill (engine TTFT, batch 1)",
                      _get(rows, "engine", 1, "ttft_ms"), 25.0, False, " ms",
                      "needs the engine row"))
    kv = preset.get("kv_vs_nocache", {})
    out.append(_check(f"KV cache vs no cache at {kv.get('new_tokens', 512)} new tokens",
                      kv.get("speedup"), 10.0, True, "×", kv.get("error", "not run")))
    decode = _get(rows, "engine", big, "decode_tokens_per_s")
    gemm = ceiling.get("gemm_gflops_best")
    frac = (2 * preset["params"] * decode / (gemm * 1e9)) if decode and gemm else None
    preset["compute_fraction_batch_decode"] = frac
    out.append(_check(f"batch-{big} decode share of GEMM ceiling",
                      frac * 100 if frac is not None else None, 25.0, True, "%",
                      "needs the engine row and the ceiling"))
    out.append(_check("int8 vs fp32 tokens/s, batch 1", ratio("engine_int8", "engine", 1), 1.3,
                      True, "×", "needs both engine rows"))
    agree = preset.get("int8_agreement", {}).get("token_agreement")
    out.append(_check("int8 greedy agreement", agree * 100 if agree is not None else None,
                      95.0, True, "%", preset.get("int8_agreement", {}).get("error", "not run")))
    out.append(_check("HTTP c=1 vs bare engine batch 1", ratio("http", "engine", 1), 0.9, True,
                      "×", "needs the HTTP and engine rows"))
    out.append(_check(f"HTTP c={big} continuous vs engine static batch {big}",
                      ratio("http", "engine", big), 0.85, True, "×", "needs both rows"))
    out.append(_check("TTFT over HTTP", preset.get("http", {}).get("ttft_ms"), 35.0, False,
                      " ms", "needs the HTTP run"))
    return out


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(run: dict[str, Any]) -> str:
    m = run["machine"]
    lines = [f"# attnserve benchmark — {run['date']}", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores visible, "
             f"{m.get('memory_gb', '?')} GB RAM; {run['settings']['threads']} threads per engine. "
             f"Versions: " + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items()),
             "", f"Command: `{run['command']}`", ""]
    c = run.get("ceiling", {})
    if c:
        lines += [f"Ceiling on {c['threads']} threads: fp32 GEMM {c['gemm_n']}² "
                  f"{_fmt(c['gemm_gflops_best'])} GFLOP/s "
                  f"({', '.join(f'{k} {v:.1f}' for k, v in c['gemm_gflops'].items())}); "
                  f"memory read {_fmt(c['read_bandwidth_gbs_best'])} GB/s "
                  f"({', '.join(f'{k} {v:.1f}' for k, v in c['read_bandwidth_gbs'].items())}).", ""]
    s = run["settings"]
    lines += [f"Prompt {s['prompt_tokens']} tokens, exactly {s['new_tokens']} new tokens "
              "(end-of-sequence ignored; over HTTP it cannot be, see 'gen/req'), greedy. "
              "Ratios (×) are to transformers generate at the same batch size. Peak RSS is "
              "the peak resident memory of the process that ran the engine (its whole "
              "runtime: torch rows include torch itself); HTTP is the server process. "
              "'greedy = (2)' is the share of rows whose greedy tokens equal PyTorch with "
              "KV cache: the engines run the same weights (near-ties on random weights "
              "may flip a token); 'prefix = (4)' is the mean number of leading generated "
              "tokens equal to our fp32 engine's (same-weights check for the peers).", ""]
    if s.get("rounds", 1) > 1:
        lines += [f"Every engine was measured in {s['rounds']} rounds, in turn: each figure "
                  "is the median over the rounds of that round's median, and each ratio "
                  "between two engines the median of their per-round ratios "
                  "(`tokens_per_s_rounds` in the JSON).", ""]
    for name, p in run["presets"].items():
        lines += [f"## {name} — {p['params'] / 1e6:.2f} M parameters, weights: {p['weights']}", ""]
        lines += ["| engine | batch | tok/s | ×(3) | decode tok/s | own decode tok/s | TTFT ms "
                  "| ×(3) | p50 ms | p99 ms | peak RSS MiB | ×(3) | greedy = (2) "
                  "| prefix = (4) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in flat_rows(p):
            label = LABELS.get(r["engine"], r["engine"])
            if r["engine"] == "http":
                label += f" c={r['batch']} (gen/req {_fmt(r.get('mean_generated_tokens'))})"
            lines.append(
                f"| {label} | {r['batch']} | {_fmt(r.get('tokens_per_s'))} | "
                f"{_fmt(r.get('x_tokens_per_s'), 2)} | {_fmt(r.get('decode_tokens_per_s'))} | "
                f"{_fmt((r.get('own') or {}).get('decode_tokens_per_s'))} | "
                f"{_fmt(r.get('ttft_ms'))} | {_fmt(r.get('x_ttft'), 2)} | "
                f"{_fmt(r.get('latency_p50_ms'), 0)} | {_fmt(r.get('latency_p99_ms'), 0)} | "
                f"{_fmt(r.get('peak_rss_mb'), 0)} | {_fmt(r.get('x_peak_rss'), 2)} | "
                f"{_fmt(r.get('greedy_rows_equal_torch_kv'), 2)} | "
                f"{_fmt(r.get('greedy_prefix_equal_engine'), 1)} |")
        kv = p.get("kv_vs_nocache", {})
        if "speedup" in kv:
            lines += ["", f"KV cache vs none, batch 1, {kv['prompt_tokens']}+{kv['new_tokens']} "
                      f"tokens (random init, context widened): {kv['torch_kv_s']:.2f} s vs "
                      f"{kv['torch_nocache_s']:.2f} s → {kv['speedup']:.1f}×."]
        lines += same_file_lines(p)
        lines += agreement_lines(p)
        bwf = p.get("bandwidth_fraction_batch1") or {}
        if bwf:
            lines += ["", "Batch-1 decode as a share of the memory-bandwidth bound (weight "
                      "bytes × decode tok/s ÷ measured read bandwidth): " + ", ".join(
                          f"{LABELS.get(k, k)} {v * 100:.0f}%" for k, v in bwf.items()) + "."]
        kv = p.get("kv_cache_bytes_per_token")
        if kv:
            lines += ["", "KV cache per token (fp32 keys and values, every layer): " + ", ".join(
                f"{k} {v:,} B" for k, v in kv.items()) + "."]
        conv = p.get("conversions") or {}
        if conv:
            lines += ["", "Conversions of the transformers copy: " + "; ".join(
                f"{k}: " + ", ".join(f"{a} {_fmt(b, 1) if isinstance(b, float) else b}"
                                     for a, b in v.items()) for k, v in conv.items()) + "."]
        frac = p.get("compute_fraction_batch_decode")
        if frac is not None:
            lines += ["", f"Batch decode reaches {frac * 100:.1f}% of the GEMM ceiling "
                      "(2 × parameters × decode tok/s ÷ GEMM FLOP/s)."]
        lines += ["", "Targets:", ""]
        lines += [f"- {t['status']} — {t['target']}: {t['detail']}" for t in p["targets"]]
        for note in p.get("notes", []):
            lines.append(f"- note: {note}")
        lines.append("")
    return "\n".join(lines) + "\n"


# Our precision and llama.cpp's file that reads the same kind of weights.
PAIRS = (("engine", "llamacpp_f32", "fp32 / f32"), ("engine_int8", "llamacpp_q8_0", "int8 / q8_0"),
         ("engine_int4", "llamacpp_q4_1", "int4 / Q4_1"),
         ("engine_gguf", "llamacpp_q4_1", "GGUF blocks / Q4_1"))


def same_file_lines(p: dict[str, Any]) -> list[str]:
    """One line per precision: ours beside llama.cpp's, tokens/s at every batch size and
    the ratio, with llama.cpp's own decode rate and each side's greedy agreement."""
    rows = flat_rows(p)
    batches = sorted({r["batch"] for r in rows if r["engine"].startswith("llamacpp")})
    if not batches:
        return []
    agree = {**{f"engine_{k}": v for k, v in (p.get("quant_agreement") or {}).items()},
             **(p.get("llamacpp_agreement") or {})}

    def cells(engine: str) -> list[str]:
        return [_fmt(_get(rows, engine, b, "tokens_per_s")) for b in batches]

    def agreed(engine: str) -> str:
        value = agree.get(engine, {}).get("token_agreement")
        return "fp32 itself" if engine == "engine" else _fmt(
            value * 100 if value is not None else None) + ("%" if value is not None else "")

    head = " / ".join(str(b) for b in batches)
    lines = ["", f"Ours beside llama.cpp (tokens/s at batch {head}; ratio = ours ÷ llama.cpp; "
             "llama.cpp's own decode tok/s from llama_perf_context; agreement: teacher-forced "
             "with our fp32):", "",
             "| ours / llama.cpp | ours tok/s | llama.cpp tok/s | ratio | llama.cpp own decode "
             "| ours agree | llama.cpp agree |", "|---|---|---|---|---|---:|---:|"]
    for ours, theirs, label in PAIRS:
        if not any(r["engine"] in (ours, theirs) for r in rows):
            continue
        ratio = [_fmt(pair_ratio(rows, ours, theirs, b), 2) for b in batches]
        own = [_fmt((_row(rows, theirs, b).get("own") or {}).get("decode_tokens_per_s"))
               for b in batches]
        lines.append(f"| {label} | {' / '.join(cells(ours))} | {' / '.join(cells(theirs))} | "
                     f"{' / '.join(ratio)} | {' / '.join(own)} | {agreed(ours)} | "
                     f"{agreed(theirs)} |")
    return lines


def agreement_lines(p: dict[str, Any]) -> list[str]:
    """Teacher-forced greedy agreement with our fp32 engine: our quantised artifacts and
    each llama.cpp file, and llama.cpp's settings."""
    figures = {f"5 our engine ({k})": v for k, v in (p.get("quant_agreement") or {}).items()}
    if not figures and "token_agreement" in p.get("int8_agreement", {}):
        figures = {"5 our engine (int8)": p["int8_agreement"]}
    figures.update({LABELS.get(k, k): v for k, v in (p.get("llamacpp_agreement") or {}).items()})
    parts = [f"{name} {v['token_agreement'] * 100:.1f}% of {v['positions']}"
             if "token_agreement" in v else f"{name}: {v.get('error')}"
             for name, v in figures.items()]
    if not parts:
        return []
    lines = ["", "Greedy agreement with our fp32 (teacher-forced: fed fp32's greedy tokens, "
             "the share of positions where the same next token is chosen): "
             + "; ".join(parts) + "."]
    for name in ("llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_1"):
        info = p.get("engines", {}).get(name, {}).get("llamacpp")
        if info:
            lines += ["", f"llama.cpp settings ({name}, last context): n_ctx {info['n_ctx']}, "
                      f"n_seq_max {info['n_seq_max']}, KV type {info['type_k']} (1 = f16), "
                      f"flash_attn_type {info['flash_attn_type']} (-1 = auto), "
                      f"kv_unified {info['kv_unified']}; {info['system_info'].strip()}"]
            break
    return lines


def chart(run: dict[str, Any], path: Path) -> None:
    """Tokens/s per engine and batch size, one panel per preset (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(run["presets"].items())
    fig, axes = plt.subplots(1, max(1, len(presets)), figsize=(7 * max(1, len(presets)), 5),
                             squeeze=False)
    for ax, (name, p) in zip(axes[0], presets, strict=False):
        rows = flat_rows(p)
        engines = list(dict.fromkeys(r["engine"] for r in rows))
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / max(1, len(engines))
        for i, eng in enumerate(engines):
            xs, ys = [], []
            for j, b in enumerate(batches):
                v = _get(rows, eng, b, "tokens_per_s")
                if v:
                    xs.append(j + i * width)
                    ys.append(v)
            ax.bar(xs, ys, width, label=LABELS.get(eng, eng))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))],
                      [f"batch / c = {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{name} ({p['params'] / 1e6:.1f} M params)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"attnserve benchmark {run['date']} — {run['machine'].get('cpu', '')}, "
                 f"{run['settings']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
