"""Generation loops that run on PyTorch: ours without and with the KV cache, transformers
``generate`` on the converted GPT-2 copy, and Optimum's ORTModelForCausalLM.

Every runner generates exactly ``n_new`` greedy tokens per row (end-of-sequence ignored)
and reports when the first token of every row was known (TTFT: prefill plus one argmax).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import GenResult


class TorchNoCache:
    """The seeds' loop: every step runs the whole sequence through the model again."""

    name = "torch_nocache"

    def __init__(self, ckpt_dir: Path) -> None:
        import torch

        from model.checkpoint import load_checkpoint

        self.torch = torch
        self.model = load_checkpoint(ckpt_dir).model.eval()

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        torch = self.torch
        t0 = time.perf_counter()
        ttft = 0.0
        with torch.inference_mode():
            seq = torch.tensor(prompts, dtype=torch.long)  # (B, T)
            for step in range(n_new):
                logits = self.model(seq).logits[:, -1]  # (B, V)
                nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
                seq = torch.cat([seq, nxt], dim=1)  # (B, T + step + 1)
                if step == 0:
                    ttft = time.perf_counter() - t0
        total = time.perf_counter() - t0
        return GenResult(seq[:, len(prompts[0]):].tolist(), ttft, total)


class TorchKV(TorchNoCache):
    """Prefill once, then one token per step through our KV cache."""

    name = "torch_kv"

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        torch = self.torch
        t0 = time.perf_counter()
        out: list[Any] = []
        with torch.inference_mode():
            res = self.model(torch.tensor(prompts, dtype=torch.long))  # logits (B, T, V)
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            ttft = time.perf_counter() - t0
            out.append(nxt)
            for _ in range(n_new - 1):
                res = self.model(nxt, past_key_values=res.present)  # logits (B, 1, V)
                nxt = res.logits[:, -1].argmax(-1, keepdim=True)
                out.append(nxt)
        total = time.perf_counter() - t0
        return GenResult(torch.cat(out, dim=1).tolist(), ttft, total)


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first generated tokens arrive."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt itself
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerate:
    """transformers ``generate`` on the converted copy (``AutoModelForCausalLM``: GPT-2 or
    Llama, whichever its config names): greedy, use_cache=True, EOS suppressed."""

    name = "hf_generate"

    def __init__(self, hf_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = self._load(AutoModelForCausalLM, hf_dir)

    def _load(self, cls: Any, path: Path) -> Any:
        return cls.from_pretrained(str(path), local_files_only=True).eval()

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)  # (B, T)
        timer = _FirstTokenTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                min_new_tokens=n_new, do_sample=False, use_cache=True, streamer=timer,
                pad_token_id=self.model.config.pad_token_id)
        total = time.perf_counter() - t0
        ttft = (timer.first or t0 + total) - t0
        return GenResult(seq[:, ids.shape[1]:].tolist(), ttft, total)


class OptimumORT(HFGenerate):
    """Optimum's ORTModelForCausalLM on its own ONNX export of the converted copy."""

    name = "optimum"

    def __init__(self, optimum_dir: Path, threads: int) -> None:
        import onnxruntime as ort
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM

        self.torch = torch
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.model = ORTModelForCausalLM.from_pretrained(
            str(optimum_dir), use_cache=True, session_options=options,
            provider="CPUExecutionProvider", local_files_only=True)


def optimum_export(hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Optimum's own export (its GPT-2 recipe, with cache); run once before measuring."""
    from optimum.onnxruntime import ORTModelForCausalLM

    t0 = time.perf_counter()
    model = ORTModelForCausalLM.from_pretrained(str(hf_dir), export=True, use_cache=True,
                                                provider="CPUExecutionProvider")
    model.save_pretrained(str(out_dir))
    import optimum.version

    return {"export_s": time.perf_counter() - t0,
            "optimum_version": getattr(optimum.version, "__version__", "?")}


def kv_vs_nocache(config_dict: dict[str, Any], prompt: list[int], n_new: int) -> dict[str, Any]:
    """Our model with and without the cache for ``n_new`` tokens at batch 1, random init.

    The context must hold prompt + n_new tokens, which the presets' max_seq_len may not, so
    this one measurement builds the preset's dimensions with a longer max_seq_len.
    """
    import torch

    from model.config import GPTConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_dict(config_dict)).eval()
    runners: dict[str, TorchNoCache] = {}
    for cls in (TorchNoCache, TorchKV):
        runner = cls.__new__(cls)
        runner.torch, runner.model = torch, model
        runners[cls.name] = runner
    out: dict[str, Any] = {"new_tokens": n_new, "prompt_tokens": len(prompt)}
    tokens = {}
    for name, runner in runners.items():
        runner.generate([prompt], 4)  # warm-up
        res = runner.generate([prompt], n_new)
        out[f"{name}_s"] = res.total_s
        out[f"{name}_tokens_per_s"] = n_new / res.total_s
        tokens[name] = res.tokens[0]
    out["speedup"] = out["torch_nocache_s"] / out["torch_kv_s"]
    out["same_tokens"] = tokens["torch_nocache"] == tokens["torch_kv"]
    return out
