"""The GPT family: the seeds' GPT and OpenAI's GPT-2 (arch ``gpt``).

Pre-norm blocks with LayerNorm, learned (or fixed sinusoidal) position embeddings added
to the token embedding, Q/K/V/O projections with biases (``attn_bias``, as GPT-2 has) or
without (the seeds' model), and a biased d → d_ff → d feed-forward layer with ReLU, the
exact-erf GELU or GPT-2's tanh GELU (transformers' ``gelu_new``).

GPT-2 stores its linear layers as ``Conv1D`` with (in, out) weights and fuses Q, K and V
into one ``c_attn`` (GGUF: ``attn_qkv``, rows Q | K | V); the conversions transpose and
split them, which is exact, so an import exported back is bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from model.architectures.base import Architecture, LoRATarget, ModelConfig, Refuse, gguf_key
from model.attention import CausalSelfAttention
from model.block import PreNormBlock
from model.config import GPTConfig

if TYPE_CHECKING:
    import gguf

# transformers' ACT2FN names → ours. gelu_new and gelu_pytorch_tanh are the same tanh
# approximation; "gelu" is the exact erf form.
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                  "relu": "relu"}
TO_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


class FeedForward(nn.Module):
    """Position-wise d → d_ff → d with ReLU (the seeds' choice), exact GELU, or GPT-2's
    tanh-approximated GELU (``gelu_new`` in transformers)."""

    def __init__(self, config: ModelConfig, act: nn.Module) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)
        self.act = act
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class Gpt2(Architecture):
    """GPT-2 (GPT2LMHeadModel, GGUF ``gpt2``) and the seeds' GPT."""

    name = "gpt"
    hf_model_types = ("gpt2",)
    gguf_names = ("gpt2",)
    positions = ("learned", "sinusoidal")
    activations = ("relu", "gelu", "gelu_tanh")
    default_preset = "small"
    norm = "layer"
    mlp = "plain"
    hf_class = "GPT2LMHeadModel"
    # Buffers older transformers versions saved with the weights (the causal mask).
    hf_ignored_suffixes = (".attn.bias", ".attn.masked_bias")
    # llama.cpp's GPT-2 tensors; attn_qkv holds the rows of Q | K | V.
    gguf_globals: ClassVar[Mapping[str, str]] = {
        "token_embd": "tok_emb", "position_embd": "pos_emb", "output_norm": "ln_f",
        "output": "lm_head"}
    gguf_layers: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "attn_norm": ("ln_1",), "ffn_norm": ("ln_2",),
        "attn_qkv": ("attn.w_q", "attn.w_k", "attn.w_v"), "attn_output": ("attn.w_o",),
        "ffn_up": ("ffn.up",), "ffn_down": ("ffn.down",)}

    # -- configuration -------------------------------------------------------------------
    def num_params(self, config: ModelConfig) -> int:
        """Seed 002's 2VD + L(4D² + 2DF + 4D), adapted: Q/K/V/O projections (biased with
        ``attn_bias``), biased feed-forward layers, two LayerNorms per block, a final
        LayerNorm, learned positions (sinusoidal ones are a buffer), a bias-free head."""
        v, d, f, n_layers = config.vocab_size, config.d_model, config.d_ff, config.n_layers
        head = 0 if config.tie_weights else v * d
        embeddings = v * d + (config.max_seq_len * d if config.position == "learned" else 0)
        attention = 4 * d * d + (4 * d if config.attn_bias else 0)
        per_block = attention + (d * f + f) + (f * d + d) + 2 * (2 * d)
        return embeddings + n_layers * per_block + 2 * d + head

    def config_from_hf(self, hf: dict[str, Any], refuse: Refuse) -> GPTConfig:
        architectures = hf.get("architectures") or [self.hf_class]
        if architectures != [self.hf_class]:
            raise refuse(f"architectures {architectures} are not supported; only "
                         "GPT2LMHeadModel (a causal language model) is")
        # Options that change what the network computes and that our model does not have.
        # (reorder_and_upcast_attn is refused too: its scale-then-upcast path is not ours.)
        for key, harmless in (("scale_attn_by_inverse_layer_idx", False),
                              ("reorder_and_upcast_attn", False),
                              ("add_cross_attention", False), ("scale_attn_weights", True)):
            if hf.get(key, harmless) != harmless:
                raise refuse(f"{key}={hf[key]!r} is not supported (only {harmless})")
        if hf.get("pruned_heads"):
            raise refuse("pruned_heads are not supported (every layer must keep all its heads)")
        if hf.get("quantization_config"):
            raise refuse("quantized checkpoints (quantization_config) are not supported; "
                         "import the float weights")
        act = hf.get("activation_function", "gelu_new")
        if act not in HF_ACTIVATIONS:
            raise refuse(f"activation_function {act!r} is not supported; one of "
                         f"{sorted(HF_ACTIVATIONS)}")
        try:
            d_model = int(hf.get("n_embd", 768))
            n_inner = hf.get("n_inner")
            return GPTConfig(
                vocab_size=int(hf.get("vocab_size", 50257)),
                d_model=d_model,
                n_heads=int(hf.get("n_head", 12)),
                n_layers=int(hf.get("n_layer", 12)),
                d_ff=int(n_inner) if n_inner is not None else 4 * d_model,
                max_seq_len=int(hf.get("n_positions", 1024)),
                position="learned",
                activation=HF_ACTIVATIONS[act],
                tie_weights=bool(hf.get("tie_word_embeddings", True)),
                layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                attn_bias=True,
            )
        except (TypeError, ValueError) as exc:
            raise refuse(f"unsupported dimensions: {exc}") from exc

    def hf_config(self, config: ModelConfig, special: dict[str, Any]) -> dict[str, Any]:
        """GPT2Config fields making transformers compute exactly what ours computes: a
        sinusoidal table is written into ``wpe``, missing attention biases as zeros."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.max_seq_len,
            "n_ctx": config.max_seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
            "n_inner": config.d_ff,
            # transformers' "gelu" is the exact-erf GELU, like torch.nn.GELU(); GPT-2's own
            # "gelu_new" is the tanh approximation, our gelu_tanh.
            "activation_function": TO_HF_ACTIVATIONS[config.activation],
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0,
            "layer_norm_epsilon": config.layer_norm_eps,
            "initializer_range": 0.02,
            "scale_attn_weights": True,  # divide by √d_k, as ours does
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": config.tie_weights,
            "use_cache": True,
            "bos_token_id": special.get("bos_token_id"),
            "eos_token_id": special.get("eos_token_id"),
            "pad_token_id": special.get("pad_token_id"),
            "torch_dtype": "float32",
        }

    def hf_config_from_gguf(self, meta: dict[str, Any], family: str,
                            tensors: Mapping[str, gguf.ReaderTensor], refuse: Refuse,
                            dequantize: Callable[[gguf.ReaderTensor], Tensor]
                            ) -> dict[str, Any]:
        key = gguf_key(meta, family, refuse)
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "n_embd": key("embedding_length"), "n_head": key("attention.head_count"),
                "n_layer": key("block_count"), "n_inner": key("feed_forward_length"),
                "n_positions": key("context_length"),
                "layer_norm_epsilon": key("attention.layer_norm_epsilon"),
                "activation_function": "gelu_new"}

    # -- weights -------------------------------------------------------------------------
    def hf_prefix(self, names: list[str]) -> str:
        """``transformer.`` (GPT2LMHeadModel) or '' (a checkpoint saved from GPT2Model)."""
        return "transformer." if any(n.startswith("transformer.") for n in names) else ""

    def hf_expected_shapes(self, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        d, f, v = config.d_model, config.d_ff, config.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"wte.weight": (v, d),
                                              "wpe.weight": (config.max_seq_len, d)}
        for i in range(config.n_layers):
            p = f"h.{i}"
            shapes.update({
                f"{p}.ln_1.weight": (d,), f"{p}.ln_1.bias": (d,),
                f"{p}.attn.c_attn.weight": (d, 3 * d), f"{p}.attn.c_attn.bias": (3 * d,),
                f"{p}.attn.c_proj.weight": (d, d), f"{p}.attn.c_proj.bias": (d,),
                f"{p}.ln_2.weight": (d,), f"{p}.ln_2.bias": (d,),
                f"{p}.mlp.c_fc.weight": (d, f), f"{p}.mlp.c_fc.bias": (f,),
                f"{p}.mlp.c_proj.weight": (f, d), f"{p}.mlp.c_proj.bias": (d,),
            })
        shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
        return {prefix + k: s for k, s in shapes.items()}

    def state_dict_from_hf(self, raw: dict[str, Tensor], config: ModelConfig
                           ) -> dict[str, Tensor]:
        """Conv1D (in, out) weights transposed, c_attn split into Q, K, V."""
        d = config.d_model
        out: dict[str, Tensor] = {"tok_emb.weight": raw["wte.weight"],  # (V, d)
                                  "pos_emb.weight": raw["wpe.weight"]}  # (L, d)
        for i in range(config.n_layers):
            h, b = f"h.{i}", f"blocks.{i}"
            w_qkv = raw[f"{h}.attn.c_attn.weight"].t()  # (3d, d): Conv1D stores (in, out)
            b_qkv = raw[f"{h}.attn.c_attn.bias"]  # (3d,)
            for j, name in enumerate(("w_q", "w_k", "w_v")):
                # clone: each projection gets its own storage, not a view into c_attn
                out[f"{b}.attn.{name}.weight"] = w_qkv[j * d:(j + 1) * d].clone()  # (d, d)
                out[f"{b}.attn.{name}.bias"] = b_qkv[j * d:(j + 1) * d].clone()  # (d,)
            out[f"{b}.attn.w_o.weight"] = raw[f"{h}.attn.c_proj.weight"].t()  # (d, d)
            out[f"{b}.attn.w_o.bias"] = raw[f"{h}.attn.c_proj.bias"]
            out[f"{b}.ffn.up.weight"] = raw[f"{h}.mlp.c_fc.weight"].t()  # (d_ff, d)
            out[f"{b}.ffn.up.bias"] = raw[f"{h}.mlp.c_fc.bias"]
            out[f"{b}.ffn.down.weight"] = raw[f"{h}.mlp.c_proj.weight"].t()  # (d, d_ff)
            out[f"{b}.ffn.down.bias"] = raw[f"{h}.mlp.c_proj.bias"]
            for ln in ("ln_1", "ln_2"):
                out[f"{b}.{ln}.weight"] = raw[f"{h}.{ln}.weight"]
                out[f"{b}.{ln}.bias"] = raw[f"{h}.{ln}.bias"]
        out["ln_f.weight"], out["ln_f.bias"] = raw["ln_f.weight"], raw["ln_f.bias"]
        # Tied: GPT2LMHeadModel ties the head to wte whatever lm_head.weight a file holds.
        out["lm_head.weight"] = raw["wte.weight"] if config.tie_weights else raw["lm_head.weight"]
        return out

    def state_dict_to_hf(self, model: Any) -> dict[str, Tensor]:
        """Our names and layouts → GPT-2's (Conv1D weights are (in, out))."""
        config: ModelConfig = model.config
        d = config.d_model
        out: dict[str, Tensor] = {}

        def put(name: str, tensor: Any) -> None:
            out[name] = tensor.detach().to(torch.float32).contiguous().clone()

        put("transformer.wte.weight", model.tok_emb.weight)  # (V, d)
        if model.pos_emb is not None:
            put("transformer.wpe.weight", model.pos_emb.weight)  # (L, d)
        else:
            put("transformer.wpe.weight", model.pos_table)  # (L, d): the fixed sinusoid table
        zeros_3d = torch.zeros(3 * d)
        zeros_d = torch.zeros(d)
        biased = config.attn_bias
        blocks: Any = model.blocks
        for i, block in enumerate(blocks):
            p = f"transformer.h.{i}"
            attn = block.attn
            put(f"{p}.ln_1.weight", block.ln_1.weight)
            put(f"{p}.ln_1.bias", block.ln_1.bias)
            qkv = torch.cat([attn.w_q.weight, attn.w_k.weight, attn.w_v.weight], dim=0)  # (3d, d)
            put(f"{p}.attn.c_attn.weight", qkv.t())  # (d, 3d)
            put(f"{p}.attn.c_attn.bias", torch.cat([attn.w_q.bias, attn.w_k.bias,
                                                    attn.w_v.bias]) if biased else zeros_3d)
            put(f"{p}.attn.c_proj.weight", attn.w_o.weight.t())  # (d, d)
            put(f"{p}.attn.c_proj.bias", attn.w_o.bias if biased else zeros_d)
            put(f"{p}.ln_2.weight", block.ln_2.weight)
            put(f"{p}.ln_2.bias", block.ln_2.bias)
            put(f"{p}.mlp.c_fc.weight", block.ffn.up.weight.t())  # (d, d_ff)
            put(f"{p}.mlp.c_fc.bias", block.ffn.up.bias)
            put(f"{p}.mlp.c_proj.weight", block.ffn.down.weight.t())  # (d_ff, d)
            put(f"{p}.mlp.c_proj.bias", block.ffn.down.bias)
        put("transformer.ln_f.weight", model.ln_f.weight)
        put("transformer.ln_f.bias", model.ln_f.bias)
        if not config.tie_weights:
            put("lm_head.weight", model.lm_head.weight)  # (V, d)
        return out

    def lora_targets(self, config: ModelConfig) -> list[LoRATarget]:
        """GPT-2's Conv1D layers: c_attn (Q | K | V), attn.c_proj, mlp.c_fc, mlp.c_proj."""
        parts = (("attn.c_attn", ("attn.w_q", "attn.w_k", "attn.w_v")),
                 ("attn.c_proj", ("attn.w_o",)), ("mlp.c_fc", ("ffn.up",)),
                 ("mlp.c_proj", ("ffn.down",)))
        return [LoRATarget(f"transformer.h.{i}.{theirs}",
                           tuple(f"blocks.{i}.{o}" for o in ours), conv1d=True)
                for i in range(config.n_layers) for theirs, ours in parts]

    # -- PyTorch -------------------------------------------------------------------------
    def activation(self, config: ModelConfig) -> nn.Module:
        if config.activation == "relu":
            return nn.ReLU()
        return nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")

    def block(self, config: ModelConfig) -> nn.Module:
        """LayerNorm before attention and before the MLP."""
        eps = config.layer_norm_eps
        return PreNormBlock(nn.LayerNorm(config.d_model, eps=eps), CausalSelfAttention(config),
                            nn.LayerNorm(config.d_model, eps=eps),
                            FeedForward(config, self.activation(config)), config.dropout)

    def final_norm(self, config: ModelConfig) -> nn.Module:
        return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


ARCHITECTURE = Gpt2()
