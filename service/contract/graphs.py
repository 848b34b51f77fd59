"""Which decoder graph runs which pass: one table per artifact, in its manifest.

An artifact may hold several decoders over one weights.bin. Export writes what each
computes and when it runs into manifest.json (``graphs``); the engine picks the ones it
opens with :meth:`GraphTable.served` and every pass with :func:`graph_for_pass`. A
manifest written before the table is read from the files it lists (:meth:`GraphTable.of`),
so older artifacts serve as they did. Torch- and onnxruntime-free: the service reads it.

    model.onnx           stored weights, one row group: the I/O contract graph, run only
                         when no engine graph can (``--no-engine-graph``, a float32
                         artifact on CUDA)
    engine.onnx          stored weights, one row group: every pass, KV cache in place;
                         on CUDA too for a float16 artifact (decode steps captured)
                         (each entry names its KV cache's type, ``kv_dtype``: float16 for
                         a float16 artifact's engine graphs, and for the CPU engine graphs
                         over the GGUF ops exported with ``--kv-dtype float16``)
    engine_mixed.onnx    stored weights, two row groups: every pass, newcomers' prompts and
                         prompt chunks riding in the decode step (mixed steps, the default)
    engine_float32.onnx  a quantised artifact's weights in float32 (``--float32-twin``):
                         passes of at least ``from_tokens`` tokens, where a float32 GEMM
                         beats the quantised kernel
    engine_lora.onnx, engine_mixed_lora.onnx
                         the steps graphs with LoRA adapters per row (``adapters``): served
                         in their place when adapters are (on the CPU, every pass)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.contract.adapter_spec import adapter_modules, lora_file
from service.contract.manifest import Manifest

Runs = Literal["steps", "long passes", "fallback"]
Weights = Literal["stored", "float32"]
# Whose kernels compute the stored weights: ONNX Runtime's own (MatMul, MatMulNBits), or
# ggml's over a GGUF file's blocks as stored (GgufMatMul, service/ops: the op library must
# be built where the graph is loaded)
Kernel = Literal["onnxruntime", "ggml"]

# From how many tokens a pass runs faster on float32 weights than on the quantised kernel,
# by quantisation (SmolLM2-135M, 2 threads; docs/engine.md "Which graph runs").
FLOAT32_PASS_TOKENS = {"int4": 512, "gguf": 256, "int8": 1024}


@dataclass(frozen=True)
class GraphInterface:
    """What a loaded graph takes and gives, read from its session once (``of_session``):
    the facts a runner binds by, beside what its table entry says it computes."""

    inputs: frozenset[str]
    outputs: frozenset[str]
    # takes each row's control vector in float32 (``steer``, an input with a default, so
    # listed among the overridable initializers, not the inputs; a float16 graph's steer is
    # float16, and no vector is offered there)
    steers: bool
    kv_dtype: io.KvDtype | None = None  # its past / present caches' type (None: it has none)

    @classmethod
    def of_session(cls, session: Any) -> GraphInterface:
        """Of an onnxruntime ``InferenceSession`` (duck-typed: this module imports no
        onnxruntime)."""
        past = io.past_names(1)[0]
        caches = {"tensor(float)": "float32", "tensor(float16)": "float16"}
        kv_dtype: Any = next((caches.get(i.type, i.type) for i in session.get_inputs()
                              if i.name == past), None)
        return cls(frozenset(i.name for i in session.get_inputs()),
                   frozenset(o.name for o in session.get_outputs()),
                   any(i.name == io.STEER and i.type == "tensor(float)"
                       for i in session.get_overridable_initializers()), kv_dtype)

    @property
    def row_groups(self) -> int:
        """2: engine_mixed.onnx's second group of rows (its ``chunk_`` inputs)."""
        return 2 if es.chunk_name(io.INPUT_IDS) in self.inputs else 1

    @property
    def adapters(self) -> bool:
        """It applies LoRA adapters per row (adapter_spec.py's inputs)."""
        return bool(adapter_modules(list(self.inputs)))

    @property
    def gathers_logits(self) -> bool:
        """It takes ``logits_index`` (every engine graph exported since): the LM head runs
        on the wanted positions alone; False: every position's logits come back."""
        return es.LOGITS_INDEX in self.inputs

    @property
    def greedy_ids(self) -> bool:
        """It returns each row's argmax beside the logits (a float16 graph)."""
        return es.GREEDY_IDS in self.outputs

    def runs_passes_of(self, steps: GraphInterface) -> bool:
        """Whether this graph can run every pass the ``steps`` graph runs: the same
        inputs, or those plus a second group of rows, left idle (engine_mixed.onnx's
        float32 weights beside a quantised engine.onnx, with mixed steps off)."""
        return steps.inputs <= self.inputs and self.kv_dtype == steps.kv_dtype and all(
            name.startswith(es.CHUNK_PREFIX) for name in self.inputs - steps.inputs)


@dataclass(frozen=True)
class GraphEntry:
    """One decoder graph of an artifact: what it computes and which passes it runs."""

    file: str
    runs: Runs  # steps: every pass a long-pass graph does not take; fallback: model.onnx
    weights: Weights = "stored"  # float32: a quantised artifact's weights before quantising
    row_groups: int = 1  # 2: a second group (prompts, a chunk) rides in the decode step
    from_tokens: int = 0  # long passes: passes of at least this many tokens
    cuda: bool = False  # may run on CUDA (a float16 engine.onnx; decode steps captured)
    adapters: bool = False  # LoRA adapters per row (<stem>_lora.onnx, adapter_spec.py)
    kernel: Kernel = "onnxruntime"
    kv_dtype: io.KvDtype = "float32"  # its KV cache's type: the pool's, while it serves

    @property
    def mixes_chunks(self) -> bool:
        """A second group of rows (newcomers' prompts, a chunk) rides in each pass."""
        return self.row_groups == 2

    @classmethod
    def of_interface(cls, interface: GraphInterface, cuda: bool = False) -> GraphEntry:
        """The steps entry of an engine graph of this interface, for a session built by
        hand (tests, benchmarks); a served graph's entry is the artifact's table's."""
        file = es.ENGINE_MIXED_FILE if interface.row_groups == 2 else es.ENGINE_FILE
        return cls(lora_file(file) if interface.adapters else file, "steps",
                   row_groups=interface.row_groups, cuda=cuda, adapters=interface.adapters,
                   kv_dtype=interface.kv_dtype or "float32")

    def check(self, interface: GraphInterface) -> None:
        """ValueError unless a graph of this interface computes what this entry says (its
        row groups, its adapters, its cache's type): the one place a table's entry meets a
        session."""
        if interface.kv_dtype not in (None, self.kv_dtype):
            raise ValueError(f"{self.file} takes a {interface.kv_dtype} KV cache where the "
                             f"artifact's table says {self.kv_dtype}")
        if self.runs == "fallback":
            return
        if (interface.row_groups, interface.adapters) != (self.row_groups, self.adapters):
            raise ValueError(f"the session does not compute what {self.file} does "
                             f"({self.describe()})")

    def describe(self) -> str:
        """One line for logs and docs."""
        what = ("float32 weights" if self.weights == "float32" else "stored weights") + (
            ", GGUF blocks on ggml's kernels (GgufMatMul)" if self.kernel == "ggml" else "") + (
            ", prompts riding in decode steps" if self.row_groups == 2 else "") + (
            ", LoRA adapters per row" if self.adapters else "") + (
            ", float16 KV cache" if self.kv_dtype == "float16" else "")
        when = {"steps": "every pass", "fallback": "when no engine graph can",
                "long passes": f"passes of ≥ {self.from_tokens} tokens"}[self.runs]
        return f"{self.file} ({what}): {when}" + (", CUDA too" if self.cuda else "")


@dataclass(frozen=True)
class GraphTable:
    """The decoder graphs an artifact holds, in the order export wrote them."""

    graphs: tuple[GraphEntry, ...]

    def to_list(self) -> list[dict[str, Any]]:
        return [asdict(g) for g in self.graphs]

    @classmethod
    def from_list(cls, rows: Sequence[dict[str, Any]], kv_dtype: io.KvDtype = "float32"
                  ) -> GraphTable:
        """``kv_dtype``: the cache type of rows written before entries named theirs (the
        manifest's: every graph's then)."""
        return cls(tuple(GraphEntry(**{"kv_dtype": kv_dtype, **row}) for row in rows))

    @classmethod
    def of_files(cls, files: Collection[str], kv_dtype: io.KvDtype, float32_pass_tokens: int,
                 float32_row_groups: int, ggml: Collection[str] = (),
                 engine_kv_dtype: io.KvDtype | None = None) -> GraphTable:
        """The table of an artifact holding ``files``: what export writes, and what a
        manifest of before the table is read as (an artifact's other files: not decoders,
        or graphs no longer served). ``kv_dtype``: the graphs' cache type (the manifest's);
        ``engine_kv_dtype``: the steps graphs' where it differs (a float16 cache in the CPU
        engine graphs over the GGUF ops); ``ggml``: the files computing with GgufMatMul."""
        def kernel(file: str) -> Kernel:
            return "ggml" if file in ggml else "onnxruntime"

        steps_cache = engine_kv_dtype or kv_dtype
        entries = [GraphEntry(io.MODEL_FILE, "fallback", kernel=kernel(io.MODEL_FILE),
                              kv_dtype=kv_dtype)]
        if es.ENGINE_FILE in files:
            entries.append(GraphEntry(es.ENGINE_FILE, "steps", cuda=kv_dtype == "float16",
                                      kernel=kernel(es.ENGINE_FILE), kv_dtype=steps_cache))
        if es.ENGINE_MIXED_FILE in files:
            entries.append(GraphEntry(es.ENGINE_MIXED_FILE, "steps", row_groups=2,
                                      kernel=kernel(es.ENGINE_MIXED_FILE), kv_dtype=steps_cache))
        if es.ENGINE_FLOAT32_FILE in files and float32_pass_tokens > 0:
            entries.append(GraphEntry(es.ENGINE_FLOAT32_FILE, "long passes", "float32",
                                      float32_row_groups, float32_pass_tokens,
                                      kv_dtype=kv_dtype))
        entries += [replace(entry, file=lora_file(entry.file), cuda=False, adapters=True,
                            kernel=kernel(lora_file(entry.file)))
                    for entry in list(entries) if entry.runs == "steps"
                    and lora_file(entry.file) in files]
        return cls(tuple(entries))

    @classmethod
    def of(cls, manifest: Manifest) -> GraphTable:
        """An artifact's table: as export recorded it, or derived from its files."""
        if manifest.graphs:
            return cls.from_list(manifest.graphs, manifest.kv_dtype)
        recorded = manifest.exporter.get("float32_pass_tokens")  # the table's predecessor
        tokens = FLOAT32_PASS_TOKENS.get(str(manifest.quantization), 0)
        mixed = manifest.exporter.get("engine_mixed_steps", es.ENGINE_MIXED_FILE in manifest.files)
        return cls.of_files(manifest.files, manifest.kv_dtype,
                            int(recorded if recorded is not None else tokens),
                            2 if mixed else 1)

    def served(self, *, engine_graph: bool, mixed_steps: bool, on_cuda: bool,
               float32_pass_tokens: int | None = None,
               adapters: bool = False) -> tuple[GraphEntry, ...]:
        """The graphs a server opens, the one for steps first: on CUDA an engine graph
        that runs there, on the CPU the one with ``mixed_steps``' row groups (the other
        where the artifact lacks it) and the float32 one for long passes (from
        ``float32_pass_tokens`` tokens when given; 0: not opened); else model.onnx.

        ``adapters``: the adapter graph for steps alone (LoRA adapters per row: no
        float32 long-pass graph, never CUDA); ValueError where the artifact has none or the
        server would not run an engine graph on the CPU."""
        if adapters:
            if on_cuda or not engine_graph:
                raise ValueError("LoRA adapters are served by the engine graph on the CPU "
                                 "only (--device cpu, --engine-graph)")
            lora = [g for g in self.graphs if g.adapters and g.runs == "steps"]
            if not lora:
                raise ValueError("this artifact has no adapter graph (exported before "
                                 "adapters were served): export it again")
            groups = 2 if mixed_steps and not on_cuda else 1
            return (min(lora, key=lambda g: abs(g.row_groups - groups)),)
        steps = [g for g in self.graphs if g.runs == "steps" and engine_graph
                 and (g.cuda or not on_cuda) and not g.adapters]
        if not steps:
            return tuple(g for g in self.graphs if g.runs == "fallback")
        groups = 2 if mixed_steps and not on_cuda else 1
        chosen = min(steps, key=lambda g: abs(g.row_groups - groups))
        if on_cuda:
            return (chosen,)
        long = [g if float32_pass_tokens is None else replace(g, from_tokens=float32_pass_tokens)
                for g in self.graphs if g.runs == "long passes"]
        return (chosen, *(g for g in long if g.from_tokens > 0))


def graph_for_pass(served: Sequence[GraphEntry], tokens: int) -> GraphEntry:
    """The graph of ``served`` (steps graph first) that runs a pass of ``tokens`` tokens
    (rows × padded length, both groups): the long-pass graph whose threshold the pass
    reaches, else the steps graph."""
    reached = [g for g in served[1:] if g.runs == "long passes" and g.from_tokens <= tokens]
    return max(reached, key=lambda g: g.from_tokens, default=served[0])
