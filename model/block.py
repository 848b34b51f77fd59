"""The pre-norm transformer block every architecture builds from its own layers.

x + attn(norm_1(x)), then x + mlp(norm_2(x)): GPT-2's LayerNorm and MLP and Llama's
RMSNorm and SwiGLU are the same block with other parts (model/architectures/ picks them),
so the residual wiring and the KV cache hand-off are written once.
"""

from __future__ import annotations

from torch import Tensor, nn

from model.attention import AttentionIntermediates, CausalSelfAttention


class PreNormBlock(nn.Module):
    def __init__(self, ln_1: nn.Module, attn: CausalSelfAttention, ln_2: nn.Module,
                 ffn: nn.Module, dropout: float, post_attn: nn.Module | None = None,
                 post_ffn: nn.Module | None = None) -> None:
        """``post_attn`` / ``post_ffn``: norms of the attention's and the MLP's outputs
        before they join the residual stream (Gemma 3's sandwich)."""
        super().__init__()
        self.ln_1 = ln_1
        self.attn = attn
        self.ln_2 = ln_2
        self.ffn = ffn
        self.post_attn = post_attn
        self.post_ffn = post_ffn
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: Tensor, allowed: Tensor | None, past: tuple[Tensor, Tensor] | None,
        explicit: bool, rotary: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], AttentionIntermediates | None]:
        attn_out, present, inter = self.attn(self.ln_1(x), allowed, past, explicit, rotary)
        if self.post_attn is not None:
            attn_out = self.post_attn(attn_out)
        x = x + self.resid_dropout(attn_out)
        ffn_out = self.ffn(self.ln_2(x))
        if self.post_ffn is not None:
            ffn_out = self.post_ffn(ffn_out)
        return x + ffn_out, present, inter
