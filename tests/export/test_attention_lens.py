"""attention.onnx's logit lens, residual norms and head attribution against PyTorch.

The reference is computed here from the torch model alone: forward hooks on its modules
record each block's output (the residual), o_proj's input (the heads' z side by side), the
attention and MLP outputs as the residual adds them; the lens is ``gpt.head`` of each
residual, the attribution TransformerLens' direct logit attribution written out in torch
(the final residual's norm scale for every component, LayerNorm centring each). For the
llama, qwen2 and gemma3 layouts (random-weight transformers models imported as
``attnserve import`` does) and GPT-2's (biases everywhere, a LayerNorm, a tied head).

Under a control vector (the graph's ``steer`` input) the reference is the same hooks on the
model inside model/steering.py's ``steered()``, on 3-layer llama and GPT-2 layouts: the
vector added after block 1 reaches layer 2's attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.onnx.model_graphs import build_attention
from model.checkpoint import load_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.hf_import import import_hf_checkpoint
from model.steering import steered
from service.contract import io_spec as io
from service.contract import lens_spec as lens
from service.viz.graph_cut import cut
from tests.hf_llama import build_hf_model

FAMILIES = ("llama", "qwen2", "gemma3", "gpt2")
T = 11


def _gpt2_layout(n_layers: int = 2) -> GPT:
    torch.manual_seed(4)
    gpt = GPT(GPTConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=n_layers, d_ff=64,
                        max_seq_len=32, activation="gelu_tanh", attn_bias=True,
                        tie_weights=True)).eval()
    with torch.no_grad():  # biases and norms away from their 0 and 1 initialisation
        for p in gpt.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return gpt


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[GPT, ort.InferenceSession]:
    family = request.param
    if family == "gpt2":
        gpt = _gpt2_layout()
    else:
        root = tmp_path_factory.mktemp(family)
        build_hf_model(root / "hf", family, seed=3)
        import_hf_checkpoint(root / "hf", root / "ckpt")
        gpt = load_checkpoint(root / "ckpt").model.eval()
    graph = build_attention(gpt)
    return gpt, ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])


class Recorded:
    """What the torch modules computed, by forward hooks."""

    def __init__(self, gpt: GPT, ids: torch.Tensor) -> None:
        self.residual: list[torch.Tensor] = []  # (B, T, d) after each block
        self.z: list[torch.Tensor] = []  # o_proj's input (B, T, W)
        self.attention: list[torch.Tensor] = []  # o_proj's output, bias included
        self.mlp: list[torch.Tensor] = []  # the MLP's output as the residual adds it
        self.embedding: torch.Tensor | None = None
        hooks = [gpt.blocks[0].register_forward_pre_hook(self._embedding)]
        block: Any
        for block in gpt.blocks:
            hooks.append(block.register_forward_hook(
                lambda m, a, out: self.residual.append(out[0])))
            hooks.append(block.attn.w_o.register_forward_pre_hook(
                lambda m, a: self.z.append(a[0])))
            hooks.append(block.attn.w_o.register_forward_hook(
                lambda m, a, out: self.attention.append(out)))
            ffn = block.post_ffn if block.post_ffn is not None else block.ffn
            hooks.append(ffn.register_forward_hook(lambda m, a, out: self.mlp.append(out)))
        with torch.no_grad():
            self.logits = gpt(ids).logits  # (B, T, V)
        for hook in hooks:
            hook.remove()

    def _embedding(self, module: Any, args: tuple[Any, ...]) -> None:
        self.embedding = args[0]


def _run(session: ort.InferenceSession, ids: torch.Tensor, names: list[str],
         steer: np.ndarray | None = None, **inputs: int) -> dict[str, np.ndarray]:
    feeds = {io.INPUT_IDS: ids.numpy(), io.ATTENTION_MASK: np.ones_like(ids.numpy()),
             io.POSITION_IDS: np.arange(ids.shape[1], dtype=np.int64)[None, :]}
    feeds |= {name: np.array([value], np.int64) for name, value in inputs.items()}
    if steer is not None:
        feeds[io.STEER] = steer
    return dict(zip(names, session.run(names, feeds), strict=True))


def _scale(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """The divisor the norm module applies to x (…, d)."""
    if isinstance(norm, torch.nn.LayerNorm):
        return torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)


def _ids(gpt: GPT) -> torch.Tensor:
    return torch.randint(0, gpt.config.vocab_size, (1, T), generator=torch.Generator()
                         .manual_seed(7))


def test_logit_lens_and_norms_equal_the_torch_heads_of_each_residual(
        model: tuple[GPT, ort.InferenceSession]) -> None:
    gpt, session = model
    ids, k, target = _ids(gpt), 7, 5
    seen = Recorded(gpt, ids)
    n = gpt.config.n_layers
    names = [*(lens.residual_norm_name(i) for i in range(n)),
             *(lens.lens_output_name(i, kind) for i in range(n) for kind in lens.LENS_KINDS)]
    got = _run(session, ids, names, **{lens.TOP_K: k, lens.TARGET: target})
    for i, residual in enumerate(seen.residual):
        with torch.no_grad():
            logits = gpt.head(residual)[0]  # (T, V)
        probs = torch.softmax(logits.double(), -1)
        want_p, want_ids = probs.topk(k, -1)
        np.testing.assert_allclose(got[lens.residual_norm_name(i)][0],
                                   residual[0].norm(dim=-1).numpy(), rtol=1e-5)
        np.testing.assert_allclose(got[lens.lens_output_name(i, "top_probs")][0],
                                   want_p.numpy(), atol=1e-5)
        top = got[lens.lens_output_name(i, "top_ids")][0]
        assert top.shape == (T, k) and top.dtype == np.int64
        # ids agree where the probabilities are apart (a near tie may order either way)
        gaps = np.diff(want_p.numpy(), axis=-1)
        np.testing.assert_array_equal(top[:, 0][np.abs(gaps[:, 0]) > 1e-5],
                                      want_ids[:, 0].numpy()[np.abs(gaps[:, 0]) > 1e-5])
        np.testing.assert_allclose(got[lens.lens_output_name(i, "target_prob")][0],
                                   probs[:, target].numpy(), atol=1e-6)
        want_rank = (logits > logits[:, target:target + 1]).sum(-1).numpy()
        np.testing.assert_array_equal(got[lens.lens_output_name(i, "target_rank")][0],
                                      want_rank)
    # the last layer's lens is the model itself
    np.testing.assert_array_equal(got[lens.lens_output_name(n - 1, "top_ids")][0, :, 0],
                                  seen.logits[0].argmax(-1).numpy())


def _attribution(gpt: GPT, seen: Recorded, position: int, target: int,
                 added: torch.Tensor | None = None) -> np.ndarray:
    """TransformerLens' direct logit attribution in torch, in lens_spec.terms' order;
    ``added``: (L, d), what steered() added after each block (None: nothing)."""
    cfg, u = gpt.config, gpt.lm_head.weight[target]  # (d,)
    ln_f: Any = gpt.ln_f
    final = seen.residual[-1][0, position]  # (d,)
    layer_norm = isinstance(ln_f, torch.nn.LayerNorm)
    scale = _scale(ln_f, final)

    def logit_of(c: torch.Tensor) -> torch.Tensor:  # (…, d) → (…)
        if layer_norm:
            c = c - c.mean(-1, keepdim=True)
        return (c / scale * ln_f.weight) @ u

    assert seen.embedding is not None
    terms = [logit_of(seen.embedding[0, position])]
    hs, width = cfg.head_dim, cfg.n_heads * cfg.head_dim
    block: Any
    for i, block in enumerate(gpt.blocks):
        w_o = block.attn.w_o
        z = seen.z[i][0, position]  # (W,)
        heads = torch.stack([z[h * hs:(h + 1) * hs] @ w_o.weight[:, h * hs:(h + 1) * hs].T
                             for h in range(cfg.n_heads)])  # (nh, d)
        o_bias = w_o.bias if w_o.bias is not None else torch.zeros(cfg.d_model)
        assert w_o.weight.shape[1] == width
        if block.post_attn is not None:  # linearised at the whole attention output's scale
            s = _scale(block.post_attn, seen.attention[i][0, position])
            heads, o_bias = (heads / s * block.post_attn.weight,
                             o_bias / s * block.post_attn.weight)
        mlp = seen.mlp[i][0, position]
        down = block.ffn.down.bias
        down_bias = down if down is not None and block.post_ffn is None else torch.zeros_like(mlp)
        steer = added[i] if added is not None else torch.zeros_like(mlp)
        terms += [*logit_of(heads), logit_of(o_bias), logit_of(mlp - down_bias),
                  logit_of(down_bias), logit_of(steer)]
    beta = ln_f.bias @ u if layer_norm else torch.tensor(0.0)
    return torch.stack([*terms, beta]).detach().numpy()


@pytest.mark.parametrize("position, target", [(-1, None), (4, 3)])
def test_head_attribution_equals_direct_logit_attribution_and_sums_to_the_logit(
        model: tuple[GPT, ort.InferenceSession], position: int, target: int | None) -> None:
    gpt, session = model
    ids = _ids(gpt)
    seen = Recorded(gpt, ids)
    names = [lens.ATTRIBUTION_TARGET, lens.ATTRIBUTION_LOGIT, lens.ATTRIBUTION_TERMS]
    inputs = {lens.POSITION: position} | ({} if target is None else {lens.TARGET: target})
    got = _run(session, ids, names, **inputs)
    logits = seen.logits[0, position]  # (V,)
    want_target = int(logits.argmax()) if target is None else target
    assert got[lens.ATTRIBUTION_TARGET].tolist() == [want_target]
    assert got[lens.ATTRIBUTION_LOGIT][0, 0] == pytest.approx(float(logits[want_target]),
                                                              abs=1e-4)
    terms = got[lens.ATTRIBUTION_TERMS][0]
    assert terms.shape == (len(lens.terms(gpt.config.n_layers, gpt.config.n_heads)),)
    with torch.no_grad():
        want = _attribution(gpt, seen, position, want_target)
    np.testing.assert_allclose(terms, want, atol=1e-4)
    # the decomposition is exact: every term (biases included) sums to the torch logit
    assert float(terms.astype(np.float64).sum()) == pytest.approx(float(logits[want_target]),
                                                                  abs=1e-4)
    assert float(want.sum()) == pytest.approx(float(logits[want_target]), abs=1e-4)


def test_the_maps_cut_from_the_graph_keep_none_of_its_look_inside_nodes(
        model: tuple[GPT, ort.InferenceSession]) -> None:
    """What the service runs for the attention maps (the graph cut to them: ONNX Runtime
    itself runs every node) holds no lens or attribution node: they cost such a request
    nothing."""
    gpt, _ = model
    graph = build_attention(gpt)
    maps = onnx.load_from_string(cut(graph.SerializeToString(),
                                     io.attention_output_names(gpt.config.n_layers)))
    every = {n.name for n in graph.graph.node}
    kept = {n.name for n in maps.graph.node}
    looking = {n for n in every if n.startswith(("lens.", "attribution.", "residual_norm."))}
    assert looking and not kept & looking
    assert {o.name for o in maps.graph.output} == set(
        io.attention_output_names(gpt.config.n_layers))


# ---------------------------------------------------------------------------- control vectors

STEERED_FAMILIES = ("llama", "gpt2")
SCALE = 2.0


@pytest.fixture(scope="module", params=STEERED_FAMILIES)
def deep(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[GPT, ort.InferenceSession]:
    """Three layers: a direction added after block 1 reaches layer 2's attention."""
    if request.param == "gpt2":
        gpt = _gpt2_layout(n_layers=3)
    else:
        root = tmp_path_factory.mktemp(request.param)
        build_hf_model(root / "hf", request.param, seed=3, num_hidden_layers=3)
        import_hf_checkpoint(root / "hf", root / "ckpt")
        gpt = load_checkpoint(root / "ckpt").model.eval()
    graph = build_attention(gpt)
    return gpt, ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])


def _directions(gpt: GPT) -> dict[int, np.ndarray]:
    """A random direction of norm about 1 for each steerable layer (1 … L − 1)."""
    rng = np.random.default_rng(9)
    d = gpt.config.d_model
    return {k: (rng.standard_normal(d) / np.sqrt(d)).astype(np.float32)
            for k in range(1, gpt.config.n_layers)}


def _rows(gpt: GPT, directions: dict[int, np.ndarray], scale: float) -> np.ndarray:
    """The (L, d) steer rows the service binds: each direction times the scale in float32;
    row 0 filled with junk, which the graph must never read (block 0 is never steered)."""
    rows = np.full((gpt.config.n_layers, gpt.config.d_model), 100.0, np.float32)
    for k, direction in directions.items():
        rows[k] = direction * np.float32(scale)
    return rows


def test_a_control_vector_steers_the_maps_lens_and_attribution_as_steered_does(
        deep: tuple[GPT, ort.InferenceSession]) -> None:
    gpt, session = deep
    ids, n, k = _ids(gpt), gpt.config.n_layers, 5
    directions = _directions(gpt)
    maps = [io.attention_output_name(i, "weights") for i in range(n)]
    names = [*maps, *(lens.residual_norm_name(i) for i in range(n)),
             *(lens.lens_output_name(i, kind) for i in range(n)
               for kind in ("top_ids", "top_probs")),
             lens.ATTRIBUTION_TARGET, lens.ATTRIBUTION_LOGIT, lens.ATTRIBUTION_TERMS]
    got = _run(session, ids, names, _rows(gpt, directions, SCALE), **{lens.TOP_K: k})
    plain = _run(session, ids, names, **{lens.TOP_K: k})
    with steered(gpt, directions, SCALE), torch.no_grad():
        seen = Recorded(gpt, ids)
        inter = gpt(ids, return_intermediates=True).intermediates
        assert inter is not None
        target = int(seen.logits[0, -1].argmax())
        added = torch.stack([torch.zeros(gpt.config.d_model),
                             *(torch.from_numpy(directions[i]) * SCALE for i in range(1, n))])
        want_terms = _attribution(gpt, seen, -1, target, added)
    for i in range(n):
        np.testing.assert_allclose(got[maps[i]][0], inter[i].weights[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(got[lens.residual_norm_name(i)][0],
                                   seen.residual[i][0].norm(dim=-1).numpy(), rtol=1e-5)
        with torch.no_grad():
            probs = torch.softmax(gpt.head(seen.residual[i])[0].double(), -1)  # (T, V)
        want_p, want_ids = probs.topk(k, -1)
        np.testing.assert_allclose(got[lens.lens_output_name(i, "top_probs")][0],
                                   want_p.numpy(), atol=1e-5)
        apart = np.abs(np.diff(want_p.numpy(), axis=-1)[:, 0]) > 1e-5
        np.testing.assert_array_equal(got[lens.lens_output_name(i, "top_ids")][0][apart, 0],
                                      want_ids[:, 0].numpy()[apart])
    # blocks 0 and 1 read an unsteered stream; layer 2's attention reads the vector
    for i in (0, 1):
        np.testing.assert_array_equal(got[maps[i]], plain[maps[i]])
    assert np.abs(got[maps[2]] - plain[maps[2]]).max() > 1e-3
    np.testing.assert_array_equal(got[lens.residual_norm_name(0)],
                                  plain[lens.residual_norm_name(0)])
    # attribution: the vector is a term of its own, and the terms still sum to the logit
    assert got[lens.ATTRIBUTION_TARGET].tolist() == [target]
    terms = got[lens.ATTRIBUTION_TERMS][0]
    rows = lens.terms(n, gpt.config.n_heads)
    assert terms.shape == (len(rows),)
    np.testing.assert_allclose(terms, want_terms, atol=1e-4)
    logit = float(seen.logits[0, -1, target])
    assert got[lens.ATTRIBUTION_LOGIT][0, 0] == pytest.approx(logit, abs=1e-4)
    assert float(terms.astype(np.float64).sum()) == pytest.approx(logit, abs=1e-4)
    steer_terms = terms[[rows.index(f"l{i}.control_vector") for i in range(n)]]
    assert steer_terms[0] == 0.0 and np.abs(steer_terms[1:]).max() > 1e-3


def test_a_control_vector_at_scale_zero_changes_nothing(
        deep: tuple[GPT, ort.InferenceSession]) -> None:
    gpt, session = deep
    ids, n = _ids(gpt), gpt.config.n_layers
    names = [*io.attention_output_names(n), *lens.inspect_output_names(n)]
    zero = _rows(gpt, _directions(gpt), 0.0)
    zero[0] = 0.0
    got, plain = _run(session, ids, names, zero), _run(session, ids, names)
    for name in names:
        np.testing.assert_array_equal(got[name], plain[name], err_msg=name)
