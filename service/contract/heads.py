"""The one definition of how a config's attention heads are laid out.

The model's config (model/config.py) and the artifact's (io_spec.ArtifactConfig) hold the
same four numbers; both derive a head's width, the cache's heads and which key/value head
a query head reads from here, so a new family's head layout is written once.
"""

from __future__ import annotations


class HeadGeometry:
    """Mixin for a config with ``d_model``, ``n_heads``, ``n_kv_heads`` and ``head_size``."""

    d_model: int
    n_heads: int
    n_kv_heads: int | None  # key/value heads under grouped-query attention; None: n_heads
    head_size: int | None  # a head's width where it is not d_model / n_heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Heads of the KV cache: fewer than query heads under grouped-query attention."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def kv_head_of(self, head: int) -> int:
        """The key/value head query head ``head`` reads (transformers' repeat_kv order)."""
        return head // (self.n_heads // self.kv_heads)
