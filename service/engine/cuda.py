"""engine.onnx on the GPU: the KV pool in device memory, decode steps replayed as CUDA graphs.

A float16 artifact's engine graph runs wholly on ONNX Runtime's CUDA provider (its
GroupQueryAttention takes float16 or bfloat16 only, which is why a float32 artifact decodes
with model.onnx there: model_graph_runner.py). Three things keep a decode step on the device:

- **The KV pool lives there** (``DeviceKVPool``): one device buffer per layer's keys and
  values, allocated once, bound by pointer as every pass's past and present exactly as the
  host pool is (engine_graph_runner.py), so GroupQueryAttention writes each new column in place
  and no cache crosses the bus. A row moved by compaction is copied device to device by a
  one-node ONNX Runtime graph (``DeviceCopier``): no CUDA library beyond ONNX Runtime's.
- **Decode steps are CUDA graphs** (``CapturedDecode``): the kernels of a step, about a
  dozen per layer, are launched once at capture and then replayed with one call, which is
  what a 135M model's step costs on a fast GPU (launches, not arithmetic). ONNX Runtime
  captures a graph per ``gpu_graph_id`` over fixed addresses, so each batch-size bucket
  (1, 2, 4, … up to the pool's slots) has its own inputs on the device, written in place
  before each replay, and binds the pool's first slots: a batch of n rows is replayed in
  the smallest bucket that holds it when its rows sit at slots [0, n) and the bucket's
  other slots are free (the padding rows write one column of a free slot, which nothing
  reads). GroupQueryAttention reads each row's length from ``seqlens_k`` on the device and
  sizes its work by the buffer's length M, so ``total_sequence_length`` (read on the host,
  hence frozen at capture) is fed as M. Prefill, prompt chunks and any other pass run
  uncaptured (``gpu_graph_id`` −1).
- **Only token ids come back**: the float16 graph also returns ``greedy_ids``
  (export/onnx/float16.py), so a step whose rows all decode greedily without log-probabilities
  copies B int64s to the host (rows wanting "argmax"), not (B, V) logits; and a step whose rows
  also sample, with temperature, top-k and top-p alone, has a small second graph draw them
  beside the logits (``DeviceSampler``; rows wanting "draw"), from one number per
  row that the row's own seeded generator gives on the host, as the host sampler would
  use it.
  Logits come back only for a row that asks for log-probabilities, a grammar, penalties or
  the other filters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.engine.kv_pool import KVPool, PoolShape

log = logging.getLogger(__name__)

DEVICE = "cuda"
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes that get a captured decode graph
UNCAPTURED = "-1"  # gpu_graph_id of a pass that is neither captured nor replayed


class DeviceCopier:
    """Device-to-device copies through ONNX Runtime: an Identity over a flat byte-sized
    tensor, its input and output bound to the two addresses (the CUDA provider's Identity
    copies when they differ)."""

    def __init__(self, device_id: int = 0) -> None:
        from onnx import TensorProto, helper  # the gpu extra's: only a GPU server builds this

        node = helper.make_node("Identity", ["x"], ["y"])
        graph = helper.make_graph(
            [node], "copy", [helper.make_tensor_value_info("x", TensorProto.UINT8, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.UINT8, ["n"])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = min(model.ir_version, 9)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.device_id = device_id
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=[("CUDAExecutionProvider",
                                                        {"device_id": str(device_id)})])

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        binding = self.session.io_binding()
        binding.bind_input("x", DEVICE, self.device_id, np.uint8, [nbytes], src)
        binding.bind_output("y", DEVICE, self.device_id, np.uint8, [nbytes], dst)
        self.session.run_with_iobinding(binding)


class DeviceKVPool(KVPool):
    """The KV pool in GPU memory: the same slots, lengths and token ids as ``KVPool``, its
    (S, nh, M, hs) buffers allocated once by ONNX Runtime on the device. Pages are not
    given back per slot (device memory is not paged that way): the pool costs its whole
    size from the start, and ONNX Runtime's allocator refuses one that does not fit."""

    def __init__(self, shape: PoolShape, slots: int, device_id: int = 0) -> None:
        if slots < 1:
            raise ValueError("the KV pool needs at least one slot")
        self.shape = shape
        self.slots = slots
        dims = [slots, shape.heads, shape.max_len, shape.head_dim]
        self.values = [ort.OrtValue.ortvalue_from_shape_and_type(dims, shape.dtype, DEVICE,
                                                                  device_id)
                       for _ in range(shape.layers)]  # each (S, nh, M, hs) on the device
        self.arrays = []  # no host view: a row is read only through the graphs
        self._addresses = [v.data_ptr() for v in self.values]
        self.lengths = np.zeros(slots, np.int64)  # (S,)
        self.tokens = np.zeros((slots, shape.max_len), np.int64)  # (S, M)
        self._owner = [None] * slots
        self.moves = 0
        self._can_remap = False
        self._copier = DeviceCopier(device_id)
        self.device_id = device_id
        # zeros, as the host pool's fresh pages are: a kernel that reads a tile past a row's
        # length must not meet a NaN left in the memory by someone else
        zero = ort.OrtValue.ortvalue_from_numpy(np.zeros(self.row_bytes, np.uint8), DEVICE,
                                                device_id)
        for address in self._addresses:
            for slot in range(slots):
                self._copier.copy(address + slot * self.row_bytes, zero.data_ptr(),
                                  self.row_bytes)

    @property
    def bytes_allocated(self) -> int:
        return self.slots * self.row_bytes * len(self.values)

    @property
    def resident_bytes(self) -> int:
        return self.bytes_allocated  # allocated whole on the device

    def _release(self, index: int, keep: int) -> None:
        """Nothing to give back: the device buffers stay allocated."""

    def _copy_row(self, src: int, dst: int, n: int) -> None:
        for address in self._addresses:
            self._copier.copy(address + dst * self.row_bytes, address + src * self.row_bytes,
                              self.row_bytes)


# A captured step's inputs that never change: total_sequence_length is the buffer's
# length (GroupQueryAttention sizes its work by it), and a decode step's one logits
# position is 0.
_FROZEN = frozenset({es.TOTAL_SEQUENCE_LENGTH, es.LOGITS_INDEX})


@dataclass
class _Bucket:
    """One batch size's captured decode graph: its device inputs, outputs and binding."""

    rows: int
    graph_id: str
    binding: ort.IOBinding
    inputs: dict[str, ort.OrtValue]  # engine.onnx's inputs by name, on the device
    logits: ort.OrtValue  # (b, 1, V) float32
    greedy: ort.OrtValue  # (b, 1) int64


class CapturedDecode:
    """Decode steps replayed as CUDA graphs, one per batch-size bucket (module docstring).

    ``session`` must have been created with the CUDA provider's ``enable_cuda_graph``. On
    the CPU (a host pool, ``device`` "cpu") the same bindings run without capture: what
    the tests check the buckets' padding and in-place inputs with."""

    def __init__(self, session: ort.InferenceSession, pool: KVPool, n_layers: int,
                 vocab_size: int, buckets: tuple[int, ...] = GRAPH_BUCKETS,
                 device: str = DEVICE) -> None:
        self.session, self.pool, self.device = session, pool, device
        self.device_id = pool.device_id if isinstance(pool, DeviceKVPool) else 0
        self.buckets = tuple(b for b in buckets if b <= pool.slots)
        self.vocab_size = vocab_size
        self._past, self._present = io.past_names(n_layers), io.present_names(n_layers)
        self._made: dict[int, _Bucket] = {}
        self.replays = 0  # decode steps run from a captured graph (a stat)

    def bucket_for(self, lo: int, n: int) -> int | None:
        """The bucket a decode step of ``n`` rows at slots [lo, lo + n) replays in, or
        None (not at slot 0, too many rows, or a padding slot in use)."""
        if lo != 0:
            return None
        for b in self.buckets:
            if b >= n:
                owners = self.pool._owner[n:b]
                return b if all(o is None for o in owners) else None
        return None

    def run(self, rows: int, ids: np.ndarray, seqlens: np.ndarray, greedy_only: bool
            ) -> tuple[np.ndarray | None, np.ndarray]:
        """One decode step of ``rows`` rows replayed in bucket ``self.bucket_for``'s graph:
        (logits (n, V) float32 or None when ``greedy_only``, greedy ids (n,))."""
        n = len(ids)
        bucket = self._replay(rows, ids, seqlens)
        greedy = bucket.greedy.numpy()[:n, 0]  # (n,) the only copy a greedy step makes
        if greedy_only:
            return None, greedy
        return bucket.logits.numpy()[:n, 0], greedy  # (n, V)

    def sample(self, rows: int, ids: np.ndarray, seqlens: np.ndarray,
               sampler: DeviceSampler, sampled: SampledRows) -> np.ndarray:
        """One replayed decode step whose tokens ``sampler`` draws from the logits where
        the graph left them: (n,) ids, the only copy the step makes."""
        bucket = self._replay(rows, ids, seqlens)
        b, vocab = bucket.rows, self.vocab_size
        return sampler.sample_bound(bucket.logits.data_ptr(), (b, vocab), sampled)

    def _replay(self, rows: int, ids: np.ndarray, seqlens: np.ndarray) -> _Bucket:
        bucket = self._bucket(rows)
        padded_ids = np.zeros((rows, 1), np.int64)  # (b, 1): padding rows feed token 0
        padded_ids[:len(ids), 0] = ids
        lengths = np.zeros(rows, np.int32)  # (b,) each row's cached length
        lengths[:len(seqlens)] = seqlens
        for name, value in self._feed(padded_ids, lengths).items():
            if name not in _FROZEN:
                bucket.inputs[name].update_inplace(value)
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", bucket.graph_id)
        self.session.run_with_iobinding(bucket.binding, options)
        self.replays += 1
        return bucket

    def _feed(self, ids: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """A decode step's inputs: one token (b, 1) per row at its cached length (b,)."""
        return es.engine_feed(ids, lengths[:, None], lengths, self.pool.shape.max_len,
                              np.zeros((len(ids), 1), np.int64))  # position 0's logits

    def _bucket(self, rows: int) -> _Bucket:
        if rows in self._made:
            return self._made[rows]
        b, where, device_id = rows, self.device, self.device_id

        def device(shape: list[int], dtype: type) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, where, device_id)

        feed = self._feed(np.zeros((b, 1), np.int64), np.zeros(b, np.int32))
        inputs = {name: ort.OrtValue.ortvalue_from_numpy(value, where, device_id)
                  for name, value in feed.items() if name != es.TOTAL_SEQUENCE_LENGTH}
        inputs[es.TOTAL_SEQUENCE_LENGTH] = ort.OrtValue.ortvalue_from_numpy(
            feed[es.TOTAL_SEQUENCE_LENGTH])  # read on the host
        bucket = _Bucket(rows=b, graph_id=str(len(self._made) + 1),
                         binding=self.session.io_binding(), inputs=inputs,
                         logits=device([b, 1, self.vocab_size], np.float32),
                         greedy=device([b, 1], np.int64))
        binding = bucket.binding
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        shape = [b, self.pool.shape.heads, self.pool.shape.max_len, self.pool.shape.head_dim]
        dtype = self.pool.shape.dtype
        for past, present, ptr in zip(self._past, self._present, self.pool.pointers(0),
                                      strict=True):
            binding.bind_input(past, where, device_id, dtype, shape, ptr)
            binding.bind_output(present, where, device_id, dtype, shape, ptr)
        binding.bind_ortvalue_output(io.LOGITS, bucket.logits)
        binding.bind_ortvalue_output(es.GREEDY_IDS, bucket.greedy)
        self._made[rows] = bucket
        log.info("decode steps of up to %d rows: graph %s on %s", b, bucket.graph_id, where)
        return bucket


class DeviceSampler:
    """Temperature, top-k and top-p sampling of a (B, V) float32 logits buffer where it
    lies (the decode graph's output on the GPU), as service/engine/sampling.py samples on
    the host: the same filters, then one draw u ∈ [0, 1) per row from the row's own seeded
    generator, taken where the cumulative distribution over the token ids, in id order,
    first exceeds u times its total. So a seeded request draws the same tokens on either
    device, but where float32 and float64 round a boundary of the cumulative sum apart.
    Greedy rows in the same batch take top-k 1. One small graph (TopK over the vocabulary,
    Softmax, CumSum, ScatterElements, ArgMax), B int64s back."""

    def __init__(self, device: str = DEVICE, device_id: int = 0) -> None:
        from onnx import TensorProto, helper  # the gpu extra's, as DeviceCopier's

        def value(name: str, kind: int, dims: list[Any]) -> Any:
            return helper.make_tensor_value_info(name, kind, dims)

        f, i64 = TensorProto.FLOAT, TensorProto.INT64
        const = helper.make_tensor
        nodes = [
            helper.make_node("Div", ["logits", "temperature"], ["x"]),  # (B, V)
            helper.make_node("Shape", ["logits"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["vocab"], axis=0),  # (1,)
            helper.make_node("TopK", ["x", "vocab"], ["sorted", "order"], axis=-1),  # desc
            # the k-th largest value; ties with it stay, as the host's threshold keeps them
            helper.make_node("Sub", ["top_k", "one"], ["kth_at"]),  # (B, 1)
            helper.make_node("GatherElements", ["sorted", "kth_at"], ["kth"], axis=-1),
            helper.make_node("GreaterOrEqual", ["sorted", "kth"], ["in_k"]),  # (B, V)
            helper.make_node("Where", ["in_k", "sorted", "minus_inf"], ["kept"]),
            helper.make_node("Softmax", ["kept"], ["probs"], axis=-1),  # (B, V) sorted
            helper.make_node("CumSum", ["probs", "axis_last"], ["before"], exclusive=1),
            helper.make_node("Less", ["before", "top_p"], ["in_p"]),  # smallest set ≥ p
            helper.make_node("And", ["in_k", "in_p"], ["keep"]),
            helper.make_node("Where", ["keep", "probs", "zero_f"], ["chosen"]),
            helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                             value=const("zero_v", f, [1], [0.0])),  # (B, V)
            helper.make_node("ScatterElements", ["zeros", "order", "chosen"], ["by_id"],
                             axis=-1),  # back in id order, as the host draws
            helper.make_node("CumSum", ["by_id", "axis_last"], ["cdf"]),
            # the cumulative sum's own last element, as the host draws against cdf[-1]
            helper.make_node("Gather", ["cdf", "last"], ["total"], axis=-1),  # (B, 1)
            helper.make_node("Mul", ["u", "total"], ["target"]),  # (B, 1)
            helper.make_node("Greater", ["cdf", "target"], ["past"]),
            helper.make_node("Cast", ["past"], ["past_i"], to=TensorProto.INT32),
            helper.make_node("ArgMax", ["past_i"], ["ids"], axis=-1, keepdims=0),  # first
        ]
        inits = [const("one", i64, [1], [1]), const("axis_last", i64, [], [-1]),
                 const("last", i64, [1], [-1]),
                 const("minus_inf", f, [], [float("-inf")]), const("zero_f", f, [], [0.0])]
        graph = helper.make_graph(
            nodes, "sampler",
            [value("logits", f, ["B", "V"]), value("temperature", f, ["B", 1]),
             value("top_k", i64, ["B", 1]), value("top_p", f, ["B", 1]),
             value("u", f, ["B", 1])],
            [value("ids", i64, ["B"])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = min(model.ir_version, 9)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        providers: list[Any] = (["CPUExecutionProvider"] if device == "cpu" else
                                [("CUDAExecutionProvider", {"device_id": str(device_id)})])
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=providers)
        self.device, self.device_id = device, device_id

    def sample(self, logits: np.ndarray, rows: SampledRows) -> np.ndarray:
        """(n,) int64 token ids of ``rows``' first n rows of the host's ``logits`` (b, V)
        (b ≥ n; rows past n, padding, are drawn greedily and dropped)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("logits", np.ascontiguousarray(logits, np.float32))
        return self._draw(binding, logits.shape[0], rows)

    def sample_bound(self, pointer: int, shape: tuple[int, int], rows: SampledRows
                     ) -> np.ndarray:
        """``sample`` of a (b, V) float32 buffer at ``pointer`` on this sampler's device
        (a decode graph's logits, never copied)."""
        binding = self.session.io_binding()
        binding.bind_input("logits", self.device, self.device_id, np.float32, list(shape),
                           pointer)
        return self._draw(binding, shape[0], rows)

    def _draw(self, binding: ort.IOBinding, b: int, rows: SampledRows) -> np.ndarray:
        n = len(rows.temperature)
        for name, values, fill, dtype in (("temperature", rows.temperature, 1.0, np.float32),
                                          ("top_k", rows.top_k, 1, np.int64),
                                          ("top_p", rows.top_p, 2.0, np.float32),
                                          ("u", rows.u, 0.0, np.float32)):
            column = np.full((b, 1), fill, dtype)  # (b, 1)
            column[:n, 0] = values
            binding.bind_cpu_input(name, column)
        binding.bind_output("ids", "cpu")
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[:n].astype(np.int64)


@dataclass(frozen=True)
class SampledRows:
    """Each row's sampling parameters and its draw, as DeviceSampler takes them: greedy
    rows have top_k 1; ``top_k`` V (the vocabulary) and ``top_p`` above 1 are off."""

    temperature: np.ndarray  # (n,) float32
    top_k: np.ndarray  # (n,) int64
    top_p: np.ndarray  # (n,) float32
    u: np.ndarray  # (n,) float32 in [0, 1)
