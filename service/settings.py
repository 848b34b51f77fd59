"""Service settings: every option is a CLI flag and an ATTNSERVE_* environment variable.

pydantic-settings reads the environment; `attnserve serve` passes the flags it was given
as init values, which take precedence. Limits left unset are derived from the artifact's
context length when the model loads (see ``Limits.resolve``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.contract.graphs import FLOAT32_PASS_TOKENS

Device = Literal["auto", "cpu", "cuda"]
T = TypeVar("T")



def _measured() -> str:
    """The float32 weights' measured thresholds by quantisation, for help text."""
    return ", ".join(f"{tokens} for {q}" for q, tokens in FLOAT32_PASS_TOKENS.items())

class ServeOptions(BaseModel):
    """Every setting but the artifact's path, as plain values: the engine's config is one
    (service/engine/engine.py), so a test or benchmark that builds an engine with a few
    fields gets every other as a server started without flags has it, and a new setting
    is one field here."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    device: Device = Field("auto", description="auto: CUDA when ONNX Runtime has it, else "
                                               "CPU; cuda: fail at start without it")
    served_model_name: str | None = Field(
        None, description="name in /v1/models and metrics; default: the artifact's model_name")
    max_batch_size: int = Field(32, ge=1, description="sequences decoded together per step")
    max_batch_tokens: int = Field(
        16384, ge=1, description="prompt + max_new_tokens summed over the running batch")
    max_queued_requests: int = Field(
        128, ge=1, description="requests waiting to join the batch; beyond this → 429")
    max_input_tokens: int | None = Field(
        None, ge=1, description="longest prompt in tokens; default max_total_tokens - 1")
    max_total_tokens: int | None = Field(
        None, ge=2, description="prompt + max_new_tokens bound; default the model's context")
    max_new_tokens: int | None = Field(
        None, ge=1, description="upper bound on max_new_tokens; default max_total_tokens - 1")
    api_key: SecretStr | None = Field(
        None, description="when set, generation/attention/v1 routes need Bearer auth")
    max_body_bytes: int = Field(1_048_576, ge=1, description="request bodies above → 413")
    drain_timeout: float = Field(
        30.0, ge=0, description="seconds SIGTERM waits for in-flight requests")
    intra_op_threads: int = Field(0, ge=0, description="ONNX Runtime threads; 0 = all cores")
    attention_max_concurrent: int = Field(
        1, ge=1, description="/attention requests computed at once; more wait or get 429 "
                             "(each is seconds of CPU at full length)")
    attention_max_queued: int = Field(
        4, ge=0, description="/attention requests waiting for a slot; beyond this → 429")
    attention_threads: int = Field(
        1, ge=0, description="ONNX Runtime threads of the attention session (0 = all cores); "
                             "small, so /attention cannot take the decode loop's cores")
    engine_graph: bool = Field(
        True, description="decode with the artifact's engine.onnx (in-place KV cache) when it "
                          "has one and runs on CPU, or on CUDA for a --dtype float16 "
                          "artifact; false: always model.onnx (through the same KV pool, "
                          "copied in and out every step)")
    cuda_graphs: bool = Field(
        True, description="on CUDA, with a float16 artifact's engine.onnx: replay decode "
                          "steps as CUDA graphs, one per batch-size bucket (1, 2, 4, ... "
                          "128); false: launch every kernel of every step")
    mixed_steps: bool = Field(
        True, description="decode with the artifact's engine_mixed.onnx when it has one: "
                          "newcomers' prompts and prompt chunks ride in the running rows' "
                          "decode pass (the weights read once); false: engine.onnx, whose "
                          "plain steps are a few percent faster and whose joins cost a "
                          "pass of their own")
    kv_cache_memory_mb: float | None = Field(
        None, gt=0, description="KV cache budget in MiB: the tokens the pool may hold at "
                                "once; admission counts each request's prompt + "
                                "max_new_tokens against it (default: max_batch_tokens, at "
                                "most max_batch_size x max_total_tokens)")
    prefix_caching: bool = Field(
        True, description="reuse cached keys/values of shared prompt prefixes")
    prefix_cache_memory_mb: float = Field(
        64.0, gt=0, description="memory for the prefix cache's block store, in MiB (it "
                                "fills to this as prompts are cached)")
    prefix_block_size: int = Field(16, ge=1, description="tokens per prefix-cache block")
    huge_pages: bool = Field(
        True, description="once loaded, move the weights ONNX Runtime packed (and other "
                          "memory already written) into 2 MiB pages: a decode step streams "
                          "every weight, and fewer pages mean fewer TLB misses (Linux 6.1+ "
                          "MADV_COLLAPSE; elsewhere nothing happens)")
    float32_pass_tokens: int | None = Field(
        None, ge=0, description="a quantised artifact with engine_float32.onnx runs passes "
                                "of at least this many tokens (prompts, chunks) on those "
                                "float32 weights, memory-mapped from weights.bin; 0: always "
                                "the quantised graph; default: the artifact's manifest's "
                                f"({_measured()})")
    prefill_chunk_tokens: int = Field(
        256, ge=0, description="prompts longer than this are prefilled in chunks of at most "
                               "this size between decode steps; 0: one pass")
    adaptive_prefill_chunks: bool = Field(
        True, description="size each chunk to cost about one decode step of the running "
                          "rows (at least 16 tokens), and prefill in one pass when no row "
                          "is running; false: every chunk is prefill_chunk_tokens")
    max_batch_prefill_tokens: int = Field(
        0, ge=0, description="while rows are decoding, the most prompt tokens the "
                             "newcomers admitted at one step bring (TGI's option of this "
                             "name): the rest wait for the next step, so a burst of prompts "
                             "holds the running rows for a bounded pass; the first newcomer "
                             "always goes, and an idle engine takes them all; 0: no bound")
    speculative_model: str | None = Field(
        None, description="speculative decoding: 'ngram' (prompt lookup, no second model) "
                          "or a smaller model's artifact directory with the same tokenizer; "
                          "default off")
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="tokens drafted per verification pass")
    prompt_lookup_max: int = Field(4, ge=1, description="longest n-gram prompt lookup matches")
    prompt_lookup_min: int = Field(2, ge=1, description="shortest n-gram prompt lookup matches")
    speculative_max_batch_rows: int = Field(
        1, ge=1, description="speculate only while at most this many sequences are running "
                             "(a batched decode step is the better pass beyond)")
    speculative_adaptive: bool = Field(
        True, description="a sequence stops proposing for a while when its rounds cost "
                          "more than the tokens they yield (measured); false: propose at "
                          "every step (to measure a draft's acceptance)")
    generation_config: Literal["auto", "off"] = Field(
        "auto", description="auto: the OpenAI routes take sampling fields a request leaves "
                            "unset from the artifact's generation_config.json (vLLM's "
                            "default); off: the API's neutral defaults")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the server's log level")
    lora_modules: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="LoRA adapters to serve over the model, NAME=DIR each (vLLM's "
                        "form; DIR a PEFT adapter directory); requests choose one by name "
                        "(OpenAI's model, TGI's adapter_id); in the environment, separated "
                        "by spaces or commas")
    max_loras: int = Field(
        4, ge=1, le=64, description="adapters resident at once (slots of the adapter "
                                    "graph), the least recently used evicted for another; "
                                    "every resident one costs each step a little")
    max_lora_rank: int = Field(
        16, ge=1, le=256, description="the largest adapter rank served (vLLM's default); "
                                      "each slot holds this many rows")
    runtime_lora: bool = Field(
        False, description="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), reading adapters "
                           "only under lora_dir")
    lora_dir: Path | None = Field(
        None, description="the directory runtime-loaded adapters must lie under (symlinks "
                          "leading out are refused); required with runtime_lora")

    control_vectors: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="llama.cpp control vectors to serve, NAME=FILE each (a GGUF file "
                        "`attnserve steer` or llama-cvector-generator wrote); a request "
                        "chooses one with a scale (TGI's parameters.control_vector, OpenAI's "
                        "control_vector); in the environment, separated by spaces or commas")
    max_control_scale: float = Field(
        4.0, gt=0, description="the largest |scale| a request may steer with; beyond it, "
                               "422")
    runtime_control_vectors: bool = Field(
        False, description="allow POST /v1/load_control_vector and /v1/unload_control_vector"
                           ", reading files only under control_vector_dir")
    control_vector_dir: Path | None = Field(
        None, description="the directory run-time loaded control vectors must lie under "
                          "(symlinks leading out are refused); required with "
                          "runtime_control_vectors")

    @field_validator("lora_modules", "control_vectors", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> Any:
        # the environment gives one string: NAME=DIR entries apart by spaces or commas
        if isinstance(value, str):
            return tuple(part for part in value.replace(",", " ").split() if part)
        return value

    @model_validator(mode="after")
    def _runtime_lora_reads_under_a_directory(self) -> ServeOptions:
        if self.runtime_lora and self.lora_dir is None:
            raise ValueError("runtime_lora needs lora_dir: the directory adapters may be "
                             "loaded from")
        return self

    @model_validator(mode="after")
    def _runtime_vectors_read_under_a_directory(self) -> ServeOptions:
        if self.runtime_control_vectors and self.control_vector_dir is None:
            raise ValueError("runtime_control_vectors needs control_vector_dir: the directory "
                             "control vectors may be loaded from")
        return self

    @property
    def serves_adapters(self) -> bool:
        """Whether the adapter graph runs (adapters named, or loadable at run time)."""
        return bool(self.lora_modules) or self.runtime_lora

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, key: SecretStr | None) -> SecretStr | None:
        # A blank key would let `Authorization: Bearer ` through; refuse rather than guess.
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("ATTNSERVE_API_KEY is set but empty: unset it to serve "
                             "without auth, or give a key")
        return key


class Settings(BaseSettings, ServeOptions):
    """The options of ``attnserve serve``: its flags (service/serve_cli.py), then ATTNSERVE_*
    in the environment, then the defaults."""

    model_config = SettingsConfigDict(env_prefix="ATTNSERVE_", extra="ignore",
                                      protected_namespaces=(), frozen=True)

    model: Path = Field(description="artifact directory (model.onnx, attention.onnx, ...)")


def default_of(name: str) -> Any:
    """A setting's default, for the engine's small dataclasses of settings
    (SchedulerLimits, SpeculativeConfig), which take their fields by name (``of_settings``)."""
    return ServeOptions.model_fields[name].get_default()


def of_settings(cls: type[T], options: ServeOptions, **others: Any) -> T:
    """The dataclass ``cls`` with each field named after a setting taken from ``options``
    (no hand mapping), and ``others`` for the fields that are not settings."""
    return cls(**{f.name: getattr(options, f.name) for f in fields(cls)  # type: ignore[arg-type]
                  if f.name in ServeOptions.model_fields}, **others)


def named_paths(entries: Sequence[str], option: str, what: str) -> list[tuple[str, Path]]:
    """``option``'s NAME=``what`` entries (``--lora-modules``, ``--control-vectors``) as
    (name, path); ValueError with one line for a malformed entry or a name given twice."""
    out: list[tuple[str, Path]] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{option} entry {entry!r} is not NAME={what}")
        if any(name == seen for seen, _ in out):
            raise ValueError(f"{option} names {name!r} twice")
        out.append((name, Path(path)))
    return out


@dataclass(frozen=True)
class Limits:
    """The token limits a setting may leave unset, resolved against the model's context
    length (every other limit is its setting as given)."""

    max_input_tokens: int
    max_total_tokens: int
    max_new_tokens: int

    @classmethod
    def resolve(cls, settings: Settings, context_length: int) -> Limits:
        total = settings.max_total_tokens or context_length
        if total > context_length:
            raise ValueError(f"max_total_tokens {total} exceeds the model's context length "
                             f"{context_length}")
        max_input = settings.max_input_tokens or total - 1
        max_new = settings.max_new_tokens or total - 1
        if max_input >= total:
            raise ValueError(f"max_input_tokens {max_input} must be below max_total_tokens "
                             f"{total}")
        if total > settings.max_batch_tokens:
            raise ValueError(f"max_total_tokens {total} exceeds max_batch_tokens "
                             f"{settings.max_batch_tokens}: a long request could never run")
        return cls(max_input_tokens=max_input, max_total_tokens=total, max_new_tokens=max_new)
