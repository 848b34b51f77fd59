"""A PNG heatmap grid of attention weights (layers × heads) with token labels, via Pillow.

Rows of the grid are layers and columns are heads; inside a cell, row i is query token
i and column j key token j, coloured from dark (0) to bright (1) with a viridis-like
ramp. Query tokens label the left edge and key tokens the top edge (labels are left out
when there are too many tokens to read).
"""

from __future__ import annotations

import io as _io
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# Anchor colours of matplotlib's viridis at 0, 0.25, 0.5, 0.75, 1.
_ANCHORS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98],
                     [253, 231, 37]], dtype=np.float64)
_LUT = np.stack([np.interp(np.linspace(0, 1, 256), np.linspace(0, 1, len(_ANCHORS)),
                           _ANCHORS[:, c]) for c in range(3)], axis=1).astype(np.uint8)
MAX_LABELLED_TOKENS = 48
LABEL_CHARS = 8


def _label(text: str) -> str:
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def heatmap_grid(weights: np.ndarray, tokens: Sequence[str], layers: Sequence[int],
                 heads: Sequence[int]) -> bytes:
    """PNG bytes for weights of shape (layers, heads, T, T) with values in [0, 1]."""
    n_layers, n_heads, t, _ = weights.shape
    cell = max(2, min(16, 384 // max(t, 1)))  # pixels per token
    labelled = t <= MAX_LABELLED_TOKENS
    font = ImageFont.load_default()
    label_w = 6 * LABEL_CHARS + 6 if labelled else 0
    title_h, gap = 14, 8
    side = cell * t
    top_h = (6 * LABEL_CHARS + 6) if labelled else 0
    width = n_heads * (label_w + side + gap) + gap
    height = n_layers * (title_h + top_h + side + gap) + gap
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for li in range(n_layers):
        for hi in range(n_heads):
            x0 = gap + hi * (label_w + side + gap) + label_w
            y0 = gap + li * (title_h + top_h + side + gap)
            draw.text((x0, y0), f"layer {layers[li]} head {heads[hi]}", fill="black", font=font)
            y0 += title_h + top_h
            levels = np.clip(np.nan_to_num(weights[li, hi]), 0, 1) * 255  # (T, T)
            rgb = _LUT[levels.astype(np.uint8)]  # (T, T, 3)
            tile = Image.fromarray(rgb, "RGB").resize((side, side), Image.Resampling.NEAREST)
            image.paste(tile, (x0, y0))
            if labelled:
                _draw_labels(image, draw, font, tokens, x0, y0, cell, top_h)
    out = _io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _draw_labels(image: Image.Image, draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont |
                 ImageFont.FreeTypeFont, tokens: Sequence[str], x0: int, y0: int, cell: int,
                 top_h: int) -> None:
    for i, token in enumerate(tokens):
        text = _label(token)
        draw.text((x0 - 6 * len(text) - 4, y0 + i * cell + (cell - 10) // 2), text,
                  fill="black", font=font)
        # Key labels run vertically above the columns: draw sideways, then rotate.
        strip = Image.new("RGB", (top_h, max(cell, 10)), "white")
        ImageDraw.Draw(strip).text((2, (max(cell, 10) - 10) // 2), text, fill="black",
                                   font=font)
        rotated = strip.rotate(90, expand=True)
        image.paste(rotated, (x0 + i * cell + (cell - rotated.width) // 2, y0 - top_h))
