"""The ONNX I/O contract: the one place that names every graph input and output.

It follows the Hugging Face / Optimum decoder convention so any tool that speaks it can
drive ``model.onnx``. Both export/ and service/ import this module; it needs neither
torch nor onnxruntime.

model.onnx  (B = batch_size, T = sequence_length, P = past_sequence_length)
    inputs   input_ids (int64) [B, T]
             attention_mask (int64) [B, P + T]
             position_ids (int64) [B, T]
             past_key_values.{i}.key / .value  [B, num_heads, P, head_dim]
    outputs  logits (float32) [B, T, vocab_size]
             present.{i}.key / .value  [B, num_heads, P + T, head_dim]
    (grouped-query attention, Llama family: the cache has num_key_value_heads heads)

attention.onnx (introspection, no cache)
    inputs   input_ids, attention_mask, position_ids  [B, T]
             steer (float32) [n_layers, d_model]: a control vector, row k added to the
             residual stream after block k (row 0 never read: llama.cpp steers blocks
             1 … n_layers − 1, model/steering.py), every row and position alike; an input
             with a default of zeros, so a caller that binds none steers nothing; files
             exported before it lack it (the engine graphs' [R, n_layers, d] steer:
             engine_spec.py)
    outputs  attention.{i}.{q,k,v}  [B, num_heads, T, head_dim]  (k, v per query head)
             attention.{i}.{scores,scaled_scores,weights}  [B, num_heads, T, T]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from service.contract.heads import HeadGeometry

if TYPE_CHECKING:  # the service's request bodies; the contract itself needs no pydantic
    from pydantic import BaseModel

Body = TypeVar("Body", bound="BaseModel")

# Files of an artifact directory; the manifest lists every one with its sha256.
MODEL_FILE = "model.onnx"
ATTENTION_FILE = "attention.onnx"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
# Hugging Face files carried over from the checkpoint when it has them (chat template,
# special-token names, generation defaults); the manifest pins them like the rest.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
OPTIONAL_HF_FILES = (CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE)

# Names of dynamic axes.
BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST_SEQUENCE = "past_sequence_length"
TOTAL_SEQUENCE = "past_sequence_length + sequence_length"
KV_HEADS = "num_key_value_heads"

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
STEER = "steer"  # a control vector added after each block (attention.onnx, the engine graphs)

ATTENTION_KINDS = ("q", "k", "v", "scores", "scaled_scores", "weights")
AttentionKind = Literal["q", "k", "v", "scores", "scaled_scores", "weights"]

KvDtype = Literal["float32", "float16"]


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def past_names(n_layers: int) -> list[str]:
    """past_key_values.0.key, past_key_values.0.value, past_key_values.1.key, ..."""
    return [n for i in range(n_layers) for n in (past_key_name(i), past_value_name(i))]


def present_names(n_layers: int) -> list[str]:
    return [n for i in range(n_layers) for n in (present_key_name(i), present_value_name(i))]


def model_input_names(n_layers: int) -> list[str]:
    return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(n_layers)]


def model_output_names(n_layers: int) -> list[str]:
    return [LOGITS, *present_names(n_layers)]


def attention_output_name(layer: int, kind: str) -> str:
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention output kind {kind!r}; one of {ATTENTION_KINDS}")
    return f"attention.{layer}.{kind}"


def attention_input_names() -> list[str]:
    return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS]


def attention_output_names(n_layers: int) -> list[str]:
    return [attention_output_name(i, k) for i in range(n_layers) for k in ATTENTION_KINDS]


def model_io_shapes(n_layers: int, grouped: bool = False) -> dict[str, dict[str, list[str]]]:
    """Symbolic shapes of model.onnx, as recorded in manifest.json.

    ``grouped``: grouped-query attention, whose cache has fewer heads than the queries.
    """
    heads = KV_HEADS if grouped else "num_heads"
    kv_in = [BATCH, heads, PAST_SEQUENCE, "head_dim"]
    kv_out = [BATCH, heads, TOTAL_SEQUENCE, "head_dim"]
    inputs: dict[str, list[str]] = {
        INPUT_IDS: [BATCH, SEQUENCE],
        ATTENTION_MASK: [BATCH, TOTAL_SEQUENCE],
        POSITION_IDS: [BATCH, SEQUENCE],
    }
    inputs.update({n: kv_in for n in past_names(n_layers)})
    outputs: dict[str, list[str]] = {LOGITS: [BATCH, SEQUENCE, "vocab_size"]}
    outputs.update({n: kv_out for n in present_names(n_layers)})
    return {"inputs": inputs, "outputs": outputs}


def kv_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int,
                       bytes_per_value: int = 4) -> int:
    """Bytes one token adds to the KV cache: keys and values, every layer, kv heads only."""
    return 2 * n_layers * kv_heads * head_dim * bytes_per_value


DEFAULT_MAX_NEW_TOKENS = 64  # an artifact that names no completion length gets this one


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's generation defaults; None where it is silent.

    The one class for both sources: the ``generation`` block of an artifact's config.json
    (written by the export: the completion length) and a model author's
    generation_config.json (service/artifact/generation_defaults.py parses it: sampling fields the
    OpenAI routes fill into a request that leaves them unset).
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def fill(self, body: Body) -> Body:
        """``body`` (a pydantic request model) with every sampling field it left unset
        taken from the defaults."""
        unset = {name: value for name, value in self.to_dict().items()
                 if name != "max_new_tokens" and name in type(body).model_fields
                 and name not in body.model_fields_set}
        return body.model_copy(update=unset) if unset else body


@dataclass(frozen=True)
class ArtifactConfig(HeadGeometry):
    """config.json of an artifact: all the service needs to know about the model."""

    model_name: str
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    max_seq_len: int  # context length: prompt plus generated tokens
    # Special ids follow the tokenizer: ours are <pad> 0, <start> 1, <end> 2; GPT-2's
    # <|endoftext|> 50256 is both bos and eos and it has no pad token (None).
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    tokenizer_kind: str  # "char" | "bpe"
    kv_dtype: KvDtype = "float32"  # dtype of past/present tensors; logits are always float32
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    # Llama family: "llama" (rotary, RMSNorm, SwiGLU) and grouped-query attention's key/
    # value heads. The defaults describe every artifact written before they existed.
    arch: str = "gpt"
    n_kv_heads: int | None = None
    # a head's width where it is not d_model / n_heads (Qwen3); written only then
    head_size: int | None = None

    def kv_bytes_per_token(self, bytes_per_value: int = 4) -> int:
        return kv_bytes_per_token(self.n_layers, self.kv_heads, self.head_dim, bytes_per_value)

    @property
    def fill_token_id(self) -> int:
        """The id padded positions hold: the pad token, else any real id (eos, else 0).

        Padding is always masked out of attention and its logits are never read, so
        without a pad token any id does.
        """
        for token_id in (self.pad_token_id, self.eos_token_id):
            if token_id is not None:
                return token_id
        return 0

    @property
    def start_token_id(self) -> int:
        """A one-token prompt for warm-ups: bos when the tokenizer has one."""
        return self.bos_token_id if self.bos_token_id is not None else self.fill_token_id

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["generation"] = self.generation.to_dict()
        if self.head_size is None:  # as every artifact written before the field existed
            del data["head_size"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArtifactConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown artifact config keys: {unknown}")
        values = dict(data)
        values["generation"] = GenerationDefaults(**values.get("generation", {}))
        return cls(**values)

    @classmethod
    def load(cls, artifact_dir: str | Path) -> ArtifactConfig:
        return cls.from_dict(json.loads((Path(artifact_dir) / CONFIG_FILE).read_text("utf-8")))
