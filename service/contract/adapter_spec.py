"""Names of the adapter graphs: an engine graph with LoRA adapters applied per row.

Export writes, beside each decoder graph it serves (engine.onnx, engine_mixed.onnx) and
beside attention.onnx, the same graph with a low-rank update added to every projection a
LoRA adapter may adapt (export/lora/adapter_graph.py); ``<stem>_lora.onnx`` over the same
weights.bin. Kept apart from the builder so the service reads it without torch.

Extra inputs (S = resident adapter slots fed this pass, R = the server's rank per slot,
N = the tokens of the pass, both row groups, row-major, the first group's first):
    lora_mask (float32) [N, S·R]: 1 in the R columns of each token's adapter slot, 0
        elsewhere; a base row's tokens are all 0
    lora.<module>.A (float32) [S·R, in]: each slot's A (r, in), zero rows up to R
    lora.<module>.B (float32) [S·R, out]: each slot's B transposed (r, out) times the
        adapter's scale for that module (alpha / r, or alpha / √r), zero rows up to R
``<module>`` is transformers' module name, as PEFT keys it
(``model.layers.0.self_attn.q_proj``). Every module of every layer is an input, whether
or not an adapter targets it (zeros where it does not). What the graph adds beside the
projection ``y = x·W`` is ``((x·Aᵀ) ⊙ mask)·B``: for each token, its own slot's
``s·(x·Aᵀ)·Bᵀ``, the Punica/S-LoRA sum over slots with every other slot masked away.
Slots are laid out slot-major, so the first S slots are a contiguous prefix of the
server's buffers: a pass feeds only the slots up to the highest one its rows use.

attention_lora.onnx takes the same inputs for its one sequence (N = T).
"""

from __future__ import annotations

LORA_MASK = "lora_mask"
LORA_PREFIX = "lora."
LORA_SUFFIX = "_lora"  # engine_mixed.onnx → engine_mixed_lora.onnx


def lora_file(graph_file: str) -> str:
    """The adapter graph of ``graph_file``."""
    stem, dot, ext = graph_file.rpartition(".")
    return f"{stem}{LORA_SUFFIX}{dot}{ext}"


def lora_a(module: str) -> str:
    return f"{LORA_PREFIX}{module}.A"


def lora_b(module: str) -> str:
    return f"{LORA_PREFIX}{module}.B"


def adapter_modules(input_names: list[str]) -> list[str]:
    """The modules an adapter graph takes A and B for, in its input order."""
    return [name[len(LORA_PREFIX):-2] for name in input_names
            if name.startswith(LORA_PREFIX) and name.endswith(".A")]
