"""A 4-bit engine graph's weights as 8-bit codes: the same values, the kernel for many rows.

``MatMulNBits`` dequantises a weight as (q − zp)·scale per block. A 4-bit code q (0..15)
and its zero point are just as valid as 8-bit ones, so widening each code to a byte, each
4-bit zero point to a byte (or writing 8, the 4-bit default, where the graph had none),
and setting ``bits=8`` gives a graph whose every dequantised weight equals the 4-bit
graph's, bit for bit; scales and every other node are unchanged. A node with float zero
points (``--quantize gguf``'s float-zp form) stays 4-bit: ONNX Runtime's 8-bit CPU kernel
refuses them.

Why keep both: ONNX Runtime's CPU kernels (MLAS, accuracy level 4: int8 activations) are
fastest at one row with 4-bit codes, and with 8-bit codes at many. Measured on
SmolLM2-135M-Instruct (2 threads, `python -m benchmarks.quant_blocks --engine ...`), a
decode step: 4-bit 11.1 / 20.9 / 64.2 ms at 1 / 8 / 32 rows, the same weights as 8-bit
codes 14.6 / 22.0 / 58.7 ms, float32 22.7 / 33.7 / 64.9 ms. The runner picks the graph by
the number of tokens in a pass (service/engine/engine_graph_runner.py). The cost is the 8-bit
codes' bytes: twice the 4-bit ones, in weights.bin and packed in memory.

The two graphs compute the same numbers only where the 8-bit kernel's products are exact:
on x86 without VNNI (AVX2, AVX-512 without its VNNI extension) MLAS multiplies unsigned
codes by signed activations with ``vpmaddubsw``, which sums each pair of products in
saturating int16 (2·143·127 for a widened 4-bit code already overflows): there the
comparison below may find the graphs apart, and the export then refuses them, saying why
(:func:`exact_int8_products`).
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from service.contract.reference import decode_steps

# /proc/cpuinfo flags of the x86 extensions whose u8·s8 dot products accumulate in int32
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def exact_int8_products(cpuinfo: str | None = None) -> bool:
    """Whether ONNX Runtime's int8-activation kernels multiply exactly on this CPU: not on
    x86 without VNNI (see the module docstring); anything else (ARM, or no /proc/cpuinfo)
    is taken to. ``cpuinfo``: that file's text (read when None)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), None)
    return flags is None or bool(VNNI_FLAGS & set(flags))

DEFAULT_4BIT_ZERO_POINT = 8  # MatMulNBits' zero point for 4-bit codes without an input


def _attributes(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes holding element 2i in the low nibble and 2i + 1 in the high one → elements."""
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def widen_4bit_codes(model: onnx.ModelProto, base: Path) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` (its external initializers read from ``base``) with every 4-bit
    ``MatMulNBits`` turned 8-bit over the same values; and how many nodes were."""
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    graph = widened.graph
    initializers = {t.name: t for t in graph.initializer}
    replaced: dict[str, onnx.TensorProto] = {}
    count = 0
    for node in graph.node:
        if node.op_type != "MatMulNBits" or _attributes(node).get("bits") != 4:
            continue
        attrs = _attributes(node)
        n, k, block = attrs["N"], attrs["K"], attrs["block_size"]
        blocks = -(-k // block)
        zero_point = node.input[3] if len(node.input) > 3 else ""
        points = (numpy_helper.to_array(initializers[zero_point], base_dir=str(base))
                  if zero_point else None)
        if points is not None and points.dtype != np.uint8:
            continue  # float zero points: ONNX Runtime's 8-bit CPU kernel refuses them
        codes_name = node.input[1]
        packed = numpy_helper.to_array(initializers[codes_name], base_dir=str(base))
        codes = _unpack_nibbles(packed.reshape(n, blocks, block // 2))  # (N, blocks, block)
        wide_codes = f"{codes_name}.codes8"
        replaced[wide_codes] = numpy_helper.from_array(codes.astype(np.uint8), wide_codes)
        node.input[1] = wide_codes
        if points is None:  # the implicit 4-bit zero point, written out for 8 bits
            zero_point = f"{codes_name}.zero_points8"
            replaced[zero_point] = numpy_helper.from_array(
                np.full(n * blocks, DEFAULT_4BIT_ZERO_POINT, np.uint8), zero_point)
            inputs = [*node.input, *[""] * (4 - len(node.input))]
            inputs[3] = zero_point
            del node.input[:]
            node.input.extend(inputs)
        else:  # packed 4-bit zero points, one a byte now
            wide_points = f"{zero_point}.zero_points8"
            unpacked = _unpack_nibbles(points.reshape(n, -1))[:, :blocks]  # (N, blocks)
            replaced[wide_points] = numpy_helper.from_array(
                np.ascontiguousarray(unpacked, np.uint8).reshape(-1), wide_points)
            node.input[3] = wide_points
        for attribute in node.attribute:
            if attribute.name == "bits":
                attribute.i = 8
        count += 1
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used and t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend([*kept, *replaced.values()])
    return widened, count


def compare_widened(gpt: Any, served: Path, widened: Path, prompts: list[list[int]],
                    steps: int = 16) -> dict[str, Any]:
    """Both graphs fed the same tokens (each prompt, then the served graph's greedy choices
    for ``steps`` steps, one row at a time, through the contract's greedy loop): the
    largest difference of the logits each step reads, the logits' scale, and whether every
    greedy choice agreed. Raises when a choice differs or the logits differ by more than
    1e-4 of their scale: the weights are the same values, so only the kernels' summation
    order may differ."""
    from export.engine_graph import EngineDecoder

    mine, theirs = EngineDecoder(served, gpt), EngineDecoder(widened, gpt)
    worst = scale = 0.0
    agreed = True
    for prompt in prompts:
        reference = list(islice(decode_steps(mine, [prompt]), steps))  # (1, V), (1,) each
        chosen = np.stack([c for _, c in reference], axis=1)  # (1, steps)
        for (want, picked), (got, their_pick) in zip(
                reference, decode_steps(theirs, [prompt], forced=chosen), strict=False):
            worst = max(worst, float(np.abs(want - got).max()))
            scale = max(scale, float(np.abs(want).max()))
            agreed &= bool((picked == their_pick).all())
    result = {"max_abs_diff": worst, "logit_scale": scale, "greedy_equal": agreed,
              "steps": steps, "prompts": len(prompts)}
    if not agreed or worst > 1e-4 * scale:
        why = "" if exact_int8_products() else (
            " (this CPU, x86 without AVX-VNNI or AVX-512 VNNI, sums int8 products in "
            "saturating int16: export without --codes8, or with --activations float)")
        raise ValueError(f"{widened.name} disagrees with {served.name}: {result}{why}")
    return result
