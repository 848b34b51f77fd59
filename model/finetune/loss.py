"""The loss on supervised tokens only, without a (tokens × vocabulary) tensor kept.

A fine-tune scores a minority of positions (an assistant's answer, not the prompt), and
the head is the widest matrix (SmolLM2: 49,152 × 576; logits of a 2,048-token batch would
be 400 MB, with their gradient twice that). So the head runs on the supervised positions
only, a chunk of rows at a time, and each chunk's gradient is computed right away in the
forward (the loss is a sum, so its gradient needs nothing from later chunks): the
backward only scales what was kept, (N, d) for the hidden states and, when the head
trains, (V, d) for its weight. The same idea as Liger's fused linear cross-entropy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CHUNK_ROWS = 512


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ cross-entropy(h·Wᵀ, labels) and the number of argmax hits, over rows of h."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, labels: Tensor,
                chunk: int) -> tuple[Tensor, Tensor]:
        w = weight.float()  # (V, d)
        grad_h = torch.empty_like(h, dtype=torch.float32) if h.requires_grad else None
        grad_w = torch.zeros_like(w) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        for start in range(0, h.shape[0], chunk):
            rows = h[start:start + chunk].float()  # (n, d)
            target = labels[start:start + chunk]  # (n,)
            logits = rows @ w.T  # (n, V)
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            total += (lse - logits.gather(1, target[:, None])[:, 0]).sum()
            correct += (logits.argmax(-1) == target).sum()
            if grad_h is None and grad_w is None:
                continue
            # ∂/∂logits of the sum: softmax − onehot, in the logits' own buffer
            dlogits = logits.sub_(lse[:, None]).exp_()  # (n, V)
            dlogits[torch.arange(len(target), device=h.device), target] -= 1.0
            if grad_h is not None:
                grad_h[start:start + chunk] = dlogits @ w  # (n, d)
            if grad_w is not None:
                grad_w += dlogits.T @ rows  # (V, d)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(correct)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total, correct

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, _grad_correct: Tensor
                 ) -> tuple[Tensor | None, Tensor | None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (None if grad_h is None else (grad_h * grad_total).to(h_dtype),
                None if grad_w is None else (grad_w * grad_total).to(w_dtype), None, None)


def supervised_loss(h: Tensor, weight: Tensor, labels: Tensor,
                    chunk: int = CHUNK_ROWS) -> tuple[Tensor, Tensor]:
    """(Σ cross-entropy, argmax hits) of the head ``weight`` (V, d) on the final hidden
    states ``h`` (N, d) of the supervised positions, whose next tokens are ``labels``
    (N,). Computed in float32 whatever the inputs' type (bf16 activations on CUDA); the
    gradients come back in the inputs' types."""
    total, correct = _LinearCrossEntropy.apply(h, weight, labels, chunk)
    return total, correct
