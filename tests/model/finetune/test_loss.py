"""model/finetune/loss.py: the chunked head + cross-entropy against plain torch autograd.

The reference is ``F.cross_entropy(h @ W.T, labels, reduction="sum")`` with autograd's
gradients, and ``(argmax == labels).sum()`` for the hits, on the same random inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.finetune.loss import CHUNK_ROWS, supervised_loss

N, D, V = 7, 12, 23


def inputs(dtype=torch.float32, seed: int = 0, n: int = N, w_grad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, D, generator=gen, dtype=dtype) * 2).requires_grad_(True)
    w = torch.randn(V, D, generator=gen, dtype=dtype).requires_grad_(w_grad)
    labels = torch.randint(0, V, (n,), generator=gen)
    return h, w, labels


def plain(h, w, labels, scale: float):
    """Autograd's loss, hits and gradients on the plain expression, computed in float64
    (so that the comparison measures the function's float32 rounding alone) and returned
    in the inputs' dtype."""
    h_ref = h.detach().double().requires_grad_(True)
    w_ref = w.detach().double().requires_grad_(w.requires_grad)
    logits = h_ref @ w_ref.T
    loss = F.cross_entropy(logits, labels, reduction="sum")
    (loss * scale).backward()
    hits = int((logits.argmax(-1) == labels).sum())
    grad_w = None if w_ref.grad is None else w_ref.grad.to(w.dtype)
    return loss.detach().to(h.dtype), hits, h_ref.grad.to(h.dtype), grad_w


def close(got, want, rtol: float = 1e-5) -> None:
    """Equal to float32 rounding, relative to the tensor's largest entry."""
    atol = rtol * float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("chunk", [1, 3, N, N + 5, CHUNK_ROWS])
def test_loss_hits_and_gradients_equal_autograds(chunk: int) -> None:
    h, w, labels = inputs()
    labels[0] = int((h[0] @ w.T).argmax())  # at least one hit
    labels[1] = int((h[1] @ w.T).argmin())  # and one miss
    want, want_hits, want_gh, want_gw = plain(h, w, labels, 0.7)

    total, hits = supervised_loss(h, w, labels, chunk=chunk)
    assert total.shape == () and total.dtype == torch.float32
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    assert hits.dtype == torch.int64 and not hits.requires_grad
    assert 1 <= int(hits) == want_hits < N
    (total * 0.7).backward()
    close(h.grad, want_gh)
    close(w.grad, want_gw)


def test_default_chunk_and_large_logits() -> None:
    """Logits in the hundreds (no overflow: log-sum-exp), the default chunk."""
    h, w, labels = inputs(seed=1)
    with torch.no_grad():
        h.mul_(40.0)
    want, want_hits, want_gh, want_gw = plain(h, w, labels, 1.0)
    assert float((h @ w.T).detach().abs().max()) > 100
    total, hits = supervised_loss(h, w, labels)
    total.backward()
    assert torch.isfinite(total)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-4)
    assert int(hits) == want_hits
    close(h.grad, want_gh)
    close(w.grad, want_gw)


def test_frozen_head_gets_no_gradient() -> None:
    h, w, labels = inputs(seed=2, w_grad=False)
    want, _, want_gh, _ = plain(h, w, labels, 0.7)
    total, _ = supervised_loss(h, w, labels, chunk=3)
    (total * 0.7).backward()
    assert w.grad is None
    close(h.grad, want_gh)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_no_grad_inputs_give_the_value_alone() -> None:
    h, w, labels = inputs(seed=3, w_grad=False)
    h = h.detach()
    want, want_hits, _, _ = plain(h, w, labels, 1.0)
    total, hits = supervised_loss(h, w, labels, chunk=2)
    assert not total.requires_grad
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    assert int(hits) == want_hits


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_inputs_keep_their_dtype_in_the_gradients(dtype: torch.dtype) -> None:
    """The function computes in float32 whatever the inputs' dtype (the total is float32);
    the gradients come back in each input's own dtype."""
    h, w, labels = inputs(dtype, seed=4)
    want, want_hits, want_gh, want_gw = plain(h, w, labels, 0.7)
    total, hits = supervised_loss(h, w, labels, chunk=4)
    (total * 0.7).backward()
    assert total.dtype == torch.float32
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert int(hits) == want_hits
    rtol = 1e-5 if dtype == torch.float64 else 1e-2  # bfloat16: 8 bits of mantissa
    torch.testing.assert_close(total.detach().to(dtype), want, rtol=rtol, atol=rtol)
    close(h.grad, want_gh, rtol)
    close(w.grad, want_gw, rtol)


def test_gradient_scales_with_the_upstream_gradient() -> None:
    """The backward multiplies what the forward kept by the incoming gradient: two
    different scales on two separate calls give gradients in that ratio."""
    h, w, labels = inputs(seed=5)
    total, _ = supervised_loss(h, w, labels, chunk=2)
    (g1,) = torch.autograd.grad(total * 0.25, h)
    total, _ = supervised_loss(h, w, labels, chunk=2)
    (g2,) = torch.autograd.grad(total * -3.0, h)
    _, _, want_gh, _ = plain(h, w, labels, 1.0)
    close(g1, 0.25 * want_gh)
    close(g2, -3.0 * want_gh)


def test_no_rows_give_zero_loss_and_zero_hits() -> None:
    h, w, labels = inputs(seed=6, n=0)
    total, hits = supervised_loss(h, w, labels, chunk=4)
    assert float(total.detach()) == 0.0 and int(hits) == 0
    (total * 0.7).backward()
    assert h.grad.shape == (0, D)
    assert torch.equal(w.grad, torch.zeros(V, D))
