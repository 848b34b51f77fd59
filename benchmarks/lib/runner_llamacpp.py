"""llama.cpp through llama-cpp-python's low-level API (runs only in the side env,
benchmarks/llamacpp_env.py), at any batch size.

``quantize`` is llama.cpp's own quantiser (``llama_model_quantize``, what the
llama-quantize tool calls), e.g. an f32 GGUF into q8_0.

``LlamaCppBatched`` decodes B sequences together the way llama.cpp's own
``llama-batched-bench`` and ``llama-parallel`` do, since the high-level ``Llama`` class
serves one sequence:

- one context per batch size with ``n_seq_max`` = B and B × (prompt + new) cells
  (``kv_unified`` off, llama.cpp's default: each sequence its own KV stream, so a token
  attends over its own sequence's cells only), ``n_threads`` = ``n_threads_batch`` = the
  benchmark's threads, KV cache and flash attention at llama.cpp's defaults (f16, auto);
- prefill: one ``llama_batch`` holding every prompt, token i of sequence s at position i
  with ``seq_id`` s, logits requested for each prompt's last token only;
- decode: one ``llama_decode`` a step with B tokens (one per sequence, its own seq_id and
  next position), logits for all B; greedy = argmax over ``llama_get_logits`` (B, vocab),
  first index on ties as llama.cpp's greedy sampler; end-of-sequence is not a stop.

llama.cpp's own timings (``llama_perf_context``, the figures ``llama_perf_context_print``
prints) are read after the prefill and again after the decode (the counters are reset in
between): llama.cpp counts a one-token ``llama_decode`` as "eval" and a multi-token one
as "prompt eval" (and reports n_eval as at least 1), so the decode phase is n_eval tokens
over t_eval at batch 1 and n_p_eval tokens over t_p_eval above. They time the compute
only; the wall clock also holds our Python loop and the argmax.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import GenResult

FTYPES = {"q8_0": 7, "q4_1": 3}  # LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_1


def quantize(src: Path, dst: Path, kind: str, threads: int) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({kind}) failed with {rc}")
    return {"quantize_s": time.perf_counter() - t0, "bytes": dst.stat().st_size,
            "llama_cpp_python": llama_cpp.__version__}


class _Log:
    """llama.cpp's log sink: silent, except while ``capture`` collects the text."""

    def __init__(self) -> None:
        import llama_cpp

        self.capture: list[str] | None = None

        def sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            if self.capture is not None:
                self.capture.append(text.decode("utf-8", "replace"))

        self.callback = llama_cpp.llama_log_callback(sink)  # kept alive with this object
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))


class LlamaCppBatched:
    """Greedy batched decoding of token ids on one GGUF, B sequences per ``llama_decode``."""

    def __init__(self, gguf_path: Path, threads: int, n_ctx_per_seq: int, name: str) -> None:
        import llama_cpp

        self.name, self.threads, self.n_ctx_per_seq = name, threads, n_ctx_per_seq
        self.lib = llama_cpp
        self.log = _Log()
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.ctx: Any = None
        self.ctx_batch = (0, False)
        self.info: dict[str, Any] = {"system_info": llama_cpp.llama_print_system_info().decode(),
                                     "llama_cpp_python": llama_cpp.__version__}
        self.perf_print = ""

    def _context(self, batch: int, prompt_tokens: int, every_logit: bool = False) -> Any:
        """A context for ``batch`` sequences (made again when the batch size changes);
        ``every_logit``: one sequence may ask for logits at every position."""
        lib = self.lib
        if self.ctx is not None and self.ctx_batch == (batch, every_logit):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
            return self.ctx
        if self.ctx is not None:
            lib.llama_free(self.ctx)
        params = lib.llama_context_default_params()
        params.n_ctx = batch * self.n_ctx_per_seq
        params.n_seq_max = batch
        params.n_batch = max(512, batch * prompt_tokens)  # the whole prefill in one call
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = False  # keep llama_perf_context's timings (off by default)
        if every_logit:
            params.n_outputs_max_per_seq = 0  # 0: up to n_outputs_max (default 1 a sequence)
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for batch {batch}")
        self.ctx_batch = (batch, every_logit)
        self.info.update(n_ctx=int(lib.llama_n_ctx(self.ctx)), n_seq_max=batch,
                         type_k=int(params.type_k), flash_attn_type=int(params.flash_attn_type),
                         kv_unified=bool(params.kv_unified))
        return self.ctx

    def _perf(self, ctx: Any, single: bool) -> tuple[int, float]:
        """(tokens, milliseconds) llama.cpp evaluated since the last reset, in one-token
        calls (``single``) or in multi-token ones."""
        data = self.lib.llama_perf_context(ctx)
        if single:
            return int(data.n_eval), float(data.t_eval_ms)
        return int(data.n_p_eval), float(data.t_p_eval_ms)

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        import numpy as np

        lib = self.lib
        b, t = len(prompts), len(prompts[0])
        if any(len(p) != t for p in prompts):
            raise ValueError("llama.cpp runner: prompts of one batch must have one length")
        ctx = self._context(b, t)
        batch = lib.llama_batch_init(b * t, 0, 1)
        try:
            tok = np.ctypeslib.as_array(batch.token, shape=(b * t,))
            pos = np.ctypeslib.as_array(batch.pos, shape=(b * t,))
            nseq = np.ctypeslib.as_array(batch.n_seq_id, shape=(b * t,))
            want = np.ctypeslib.as_array(batch.logits, shape=(b * t,))
            tok[:] = np.asarray(prompts, dtype=np.int32).reshape(-1)  # (B·T,) sequence-major
            pos[:] = np.tile(np.arange(t, dtype=np.int32), b)
            nseq[:] = 1
            want[:] = 0
            want[t - 1::t] = 1  # logits at each prompt's last token
            for i in range(b * t):
                batch.seq_id[i][0] = i // t
            batch.n_tokens = b * t
            lib.llama_perf_context_reset(ctx)
            t0 = time.perf_counter()
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed on the prompts")
            logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(b, self.n_vocab))
            nxt = logits.argmax(axis=1).astype(np.int32)  # (B,)
            ttft = time.perf_counter() - t0
            pre_tokens, pre_ms = self._perf(ctx, b * t == 1)
            lib.llama_perf_context_reset(ctx)
            out = [nxt]
            for i in range(b):  # decode layout: token i is sequence i
                batch.seq_id[i][0] = i
            want[:b] = 1
            batch.n_tokens = b
            for step in range(n_new - 1):
                tok[:b] = nxt
                pos[:b] = t + step
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError(f"llama_decode failed at step {step}")
                logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx),
                                               shape=(b, self.n_vocab))
                nxt = logits.argmax(axis=1).astype(np.int32)  # (B,)
                out.append(nxt)
            total = time.perf_counter() - t0
            dec_tokens, dec_ms = self._perf(ctx, b == 1)
        finally:
            lib.llama_batch_free(batch)
        self.log.capture = []
        lib.llama_perf_context_print(ctx)
        self.perf_print, self.log.capture = "".join(self.log.capture), None
        own = {"prefill_tokens_per_s": pre_tokens / pre_ms * 1e3 if pre_ms else 0.0,
               "decode_tokens_per_s": dec_tokens / dec_ms * 1e3 if dec_ms else 0.0,
               "decode_tokens": float(dec_tokens), "decode_ms": dec_ms}
        tokens = np.stack(out, axis=1).tolist()  # (B, n_new)
        return GenResult(tokens, ttft, total, own=own)

    def teacher_forced(self, prompts: list[list[int]],
                       expected: list[list[int]]) -> dict[str, Any]:
        """Feed each prompt and the reference's greedy tokens in one pass; how often this
        file's argmax at each generated position is the reference's next token."""
        import numpy as np

        same = total = 0
        first_miss: list[int] = []
        for prompt, ref in zip(prompts, expected, strict=True):
            seq = list(prompt) + list(ref[:-1])
            n, t = len(seq), len(prompt)
            ctx = self._context(1, n, every_logit=True)
            batch = self.lib.llama_batch_init(n, 0, 1)
            try:
                np.ctypeslib.as_array(batch.token, shape=(n,))[:] = seq
                np.ctypeslib.as_array(batch.pos, shape=(n,))[:] = np.arange(n)
                np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
                want = np.ctypeslib.as_array(batch.logits, shape=(n,))
                want[:] = 0
                want[t - 1:] = 1  # the positions that predict the generated tokens
                for i in range(n):
                    batch.seq_id[i][0] = 0
                batch.n_tokens = n
                if self.lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed (teacher-forced pass)")
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx),
                                               shape=(len(ref), self.n_vocab))
                got = logits.argmax(axis=1)  # (steps,)
            finally:
                self.lib.llama_batch_free(batch)
            hits = got == np.asarray(ref)
            same, total = same + int(hits.sum()), total + len(ref)
            first_miss.append(int(np.argmin(np.append(hits, False))))
        return {"prompts": len(prompts), "positions": total, "token_agreement": same / total,
                "mean_positions_before_first_miss": float(np.mean(first_miss))}

    def close(self) -> None:
        if self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        self.lib.llama_model_free(self.model)
