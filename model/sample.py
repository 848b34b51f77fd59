"""Autoregressive generation in PyTorch: the reference decode loop.

Usage:
    attnserve sample --ckpt checkpoints/default --prompt "Return the" --greedy

``generate`` prefills the prompt once and then feeds one token at a time with the KV
cache; ``use_cache=False`` recomputes the whole sequence at every step instead. Both paths
see identical logits (to float rounding), which the tests assert and the benchmarks time.
Left-padded batches work through ``attention_mask`` exactly as in the ONNX contract.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from model.gpt import GPT, KVCache


@dataclass
class GenerateOutput:
    sequences: Tensor  # (B, T_prompt + n): prompt then generated ids (pad after a row's eos)
    logits: Tensor  # (B, n, vocab): raw logits that chose each generated token
    finished: Tensor  # (B,) bool: the row produced eos_token_id

    def new_tokens(self, prompt_len: int) -> Tensor:
        return self.sequences[:, prompt_len:]  # (B, n)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use greedy instead)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def next_token(logits: Tensor, *, greedy: bool, temperature: float, top_k: int | None,
               top_p: float | None, generator: torch.Generator | None) -> Tensor:
    """Pick one token per row from (B, vocab) logits."""
    if greedy:
        return logits.argmax(dim=-1)  # (B,)
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = probs.cumsum(dim=-1) - probs >= top_p  # (B, V)
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


@torch.no_grad()
def generate(
    model: GPT,
    input_ids: Tensor,  # (B, T) int64, left-padded when rows differ in length
    max_new_tokens: int,
    *,
    attention_mask: Tensor | None = None,  # (B, T): 1 real token, 0 padding
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    use_cache: bool = True,
) -> GenerateOutput:
    """Extend every row by up to ``max_new_tokens`` tokens (fewer if the context is full
    or every row has produced ``eos_token_id``)."""
    if not greedy:
        check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    b, t = input_ids.shape
    limit = model.config.max_seq_len
    if t == 0 or t > limit:
        raise ValueError(f"prompt must hold 1..{limit} tokens, got {t}")
    device = input_ids.device
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    filler = pad_token_id if pad_token_id is not None else (eos_token_id or 0)
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    sequences, chosen_logits = input_ids, []
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    past: KVCache | None = None
    step_ids = input_ids  # what the next forward call consumes
    model.eval()
    for _ in range(min(max_new_tokens, limit - t)):
        if use_cache:
            out = model(step_ids, attention_mask=mask, past_key_values=past)
            past = out.present
        else:
            out = model(sequences, attention_mask=mask)
        logits = out.logits[:, -1, :].float()  # (B, V)
        token = next_token(logits, greedy=greedy, temperature=temperature, top_k=top_k,
                           top_p=top_p, generator=generator)  # (B,)
        token = torch.where(finished, torch.full_like(token, filler), token)
        chosen_logits.append(logits)
        sequences = torch.cat([sequences, token[:, None]], dim=1)  # (B, T + i + 1)
        mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
        step_ids = token[:, None]  # (B, 1)
        if eos_token_id is not None:
            finished |= token == eos_token_id
            if bool(finished.all()):
                break
    vocab = model.config.vocab_size
    logits_out = (torch.stack(chosen_logits, dim=1) if chosen_logits
                  else torch.empty(b, 0, vocab, device=device))  # (B, n, V)
    return GenerateOutput(sequences=sequences, logits=logits_out, finished=finished)


def sample_text(
    ckpt: str | os.PathLike[str],
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    greedy: bool = False,
    device: str = "cpu",
) -> str:
    """Load a checkpoint and return the decoded continuation of ``prompt``."""
    from tokenizers import Tokenizer

    from model.checkpoint import load_checkpoint
    from model.tokenizer import decode, encode

    if not greedy:
        check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    ckpt_obj = load_checkpoint(ckpt, device=device)
    tokenizer = Tokenizer.from_file(str(ckpt_obj.tokenizer_path))
    declared = ckpt_obj.meta.tokenizer
    eos: int | None = declared.get("eos_token_id")
    # Training documents start right after <end> (GPT-2's after <|endoftext|>, its bos), so
    # an empty prompt starts from there.
    start = declared.get("bos_token_id") if declared.get("bos_token_id") is not None else eos
    prompt_ids = encode(tokenizer, prompt) or ([start] if start is not None else [])
    if not prompt_ids:
        raise ValueError("an empty prompt needs a bos or eos token, and the tokenizer has none")
    limit = ckpt_obj.model.config.max_seq_len
    if len(prompt_ids) >= limit:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {limit}")
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out = generate(ckpt_obj.model, ids, max_new_tokens, greedy=greedy, temperature=temperature,
                   top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos)
    new = out.new_tokens(len(prompt_ids))[0].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos)]
    if not prompt:
        return decode(tokenizer, new)
    # Decode prompt + continuation together so a character split across tokens survives.
    full, head = decode(tokenizer, prompt_ids + new), decode(tokenizer, prompt_ids)
    return full[len(head):] if full.startswith(head) else decode(tokenizer, new)
