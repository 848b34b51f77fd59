"""The adapter slots on their own: reading a PEFT adapter into numpy, the stacked
buffers and mask an adapter graph takes, and which adapter sits in which slot.

The references are plain numpy: each token's update is s·(x·Aᵀ)·Bᵀ of its own adapter,
with PEFT's scale (alpha / r, alpha / √r under rsLoRA, alpha_pattern per module).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from service.contract.peft_adapter import AdapterError
from service.engine.adapters import (
    AdapterLimits,
    AdapterSet,
    AdapterSlots,
    UnknownAdapter,
    confined,
    read_adapter_weights,
)

MODULES = {"model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.self_attn.k_proj": (8, 4),
           "model.layers.0.mlp.down_proj": (12, 8)}


def write_adapter(path: Path, rank: int, seed: int, modules: dict[str, tuple[int, int]] = MODULES,
                  **config: object) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A PEFT adapter directory with random A (r, in) and B (out, r); its tensors back."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    pairs = {m: (rng.standard_normal((rank, i)).astype(np.float32),
                 rng.standard_normal((o, rank)).astype(np.float32))
             for m, (i, o) in modules.items()}
    tensors = {}
    for m, (a, b) in pairs.items():
        tensors[f"base_model.model.{m}.lora_A.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.weight"] = b
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, **config}))
    return pairs


def test_read_scales_b_as_peft_does(tmp_path: Path) -> None:
    pairs = write_adapter(tmp_path / "plain", 4, seed=1)
    weights = read_adapter_weights(tmp_path / "plain", "plain", MODULES, max_rank=8)
    for m, (a, b) in pairs.items():
        np.testing.assert_array_equal(weights.modules[m][0], a)
        np.testing.assert_allclose(weights.modules[m][1], b.T * (16 / 4), rtol=1e-6)
    write_adapter(tmp_path / "rs", 4, seed=1, use_rslora=True,
                  alpha_pattern={"down_proj": 32})
    weights = read_adapter_weights(tmp_path / "rs", "rs", MODULES, max_rank=8)
    q = "model.layers.0.self_attn.q_proj"
    down = "model.layers.0.mlp.down_proj"
    np.testing.assert_allclose(weights.modules[q][1], pairs[q][1].T * (16 / 2), rtol=1e-6)
    np.testing.assert_allclose(weights.modules[down][1], pairs[down][1].T * (32 / 2), rtol=1e-6)
    assert weights.rank == 4
    assert weights.nbytes == sum(a.nbytes + b.nbytes for a, b in pairs.values())


@pytest.mark.parametrize(("change", "reason"), [
    ({"rank": 16}, "above --max-lora-rank 8"),
    ({"modules": {"model.layers.0.self_attn.q_proj": (8, 6)}}, "maps 8 → 6 features"),
    ({"modules": {"model.layers.9.self_attn.q_proj": (8, 8)}}, "does not have"),
    ({"use_dora": True}, "DoRA"),
    ({"peft_type": "IA3"}, "only LORA adapters"),
])
def test_an_adapter_that_does_not_fit_is_refused_with_its_reason(
        tmp_path: Path, change: dict[str, object], reason: str) -> None:
    options = dict(change)
    rank = int(options.pop("rank", 4))  # type: ignore[call-overload]
    modules = options.pop("modules", MODULES)
    write_adapter(tmp_path / "a", rank, seed=2, modules=modules, **options)  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match=reason):
        read_adapter_weights(tmp_path / "a", "a", MODULES, max_rank=8)


def test_a_missing_b_and_a_missing_directory_are_refused(tmp_path: Path) -> None:
    write_adapter(tmp_path / "a", 4, seed=3)
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="not both lora_A and lora_B"):
        read_adapter_weights(tmp_path / "a", "a", MODULES, max_rank=8)
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter_weights(tmp_path / "none", "none", MODULES, max_rank=8)


def test_the_masked_stacked_product_is_each_tokens_own_adapter(tmp_path: Path) -> None:
    """((x·A_allᵀ) ⊙ mask)·B_all, the adapter graph's computation, equals s·(x·Aᵀ)·Bᵀ of
    the token's slot (zero for the base), with adapters of different ranks padded."""
    slots = AdapterSlots(MODULES, AdapterLimits(max_loras=3, max_lora_rank=8))
    pairs = {1: write_adapter(tmp_path / "one", 4, seed=4),
             3: write_adapter(tmp_path / "three", 8, seed=5)}
    slots.write(1, read_adapter_weights(tmp_path / "one", "one", MODULES, 8))
    slots.write(3, read_adapter_weights(tmp_path / "three", "three", MODULES, 8))
    rows = [0, 3, 1, 3]  # a base row and rows of two adapters, two tokens each
    per_token = np.repeat(rows, 2)  # each token's slot
    rng = np.random.default_rng(6)
    for module, (width_in, width_out) in MODULES.items():
        x = rng.standard_normal((len(per_token), width_in)).astype(np.float32)
        for used, tokens in ((3, per_token), (1, per_token[:6] * (per_token[:6] < 2))):
            views = slots.views(used)  # a pass binds only the first slots its rows use
            a, b = views[f"lora.{module}.A"], views[f"lora.{module}.B"]
            got = ((x[:len(tokens)] @ a.T) * slots.mask(tokens, used)) @ b  # (N, out)
            for t, s in enumerate(tokens):
                want = np.zeros(width_out, np.float32)
                if s:
                    lora_a, lora_b = pairs[int(s)][module]
                    want = 4.0 if s == 1 else 2.0  # alpha 16 over r 4 / r 8
                    want = want * (x[t] @ lora_a.T) @ lora_b.T
                np.testing.assert_allclose(got[t], want, rtol=1e-4, atol=1e-4)


def test_a_slot_written_again_holds_only_the_new_adapter(tmp_path: Path) -> None:
    slots = AdapterSlots(MODULES, AdapterLimits(max_loras=1, max_lora_rank=8))
    write_adapter(tmp_path / "wide", 8, seed=7)
    narrow_modules = {"model.layers.0.self_attn.q_proj": (8, 8)}
    write_adapter(tmp_path / "narrow", 2, seed=8, modules=narrow_modules)
    slots.write(1, read_adapter_weights(tmp_path / "wide", "wide", MODULES, 8))
    slots.write(1, read_adapter_weights(tmp_path / "narrow", "narrow", MODULES, 8))
    k = slots.buffers["lora.model.layers.0.self_attn.k_proj.A"]
    assert not k.any()  # the module the new adapter leaves alone is zero, not the old one's
    assert not slots.buffers["lora.model.layers.0.self_attn.q_proj.A"][2:].any()


def _set(tmp_path: Path, slots: int, names: list[str]) -> AdapterSet:
    adapters = AdapterSet(AdapterSlots(MODULES, AdapterLimits(max_loras=slots, max_lora_rank=8)))
    for i, name in enumerate(names):
        write_adapter(tmp_path / name, 4, seed=10 + i)
        adapters.add(adapters.read(tmp_path / name, name))
    return adapters


def test_slots_are_taken_least_recently_used_first_and_never_from_a_running_adapter(
        tmp_path: Path) -> None:
    adapters = _set(tmp_path, 2, ["a", "b", "c"])
    a, b, c = (adapters.begin(n) for n in "abc")
    assert adapters.acquire(a) and adapters.acquire(b)
    assert adapters.resident() == {"a": 1, "b": 2}
    assert not adapters.acquire(c)  # both slots run rows: c waits
    adapters.release(a)
    assert adapters.acquire(c)  # a was idle: evicted
    assert adapters.resident() == {"b": 2, "c": 1}
    assert adapters.counts()["a"] == {"loads": 1, "evictions": 1}
    adapters.release(c)
    assert adapters.acquire(a)  # read again from its files: c, idle, leaves
    assert adapters.counts()["a"]["loads"] == 2
    assert adapters.slot_of(a.id) == 1 and adapters.slot_of(0) == 0


def test_an_unload_refuses_new_requests_at_once_and_waits_for_those_in_flight(
        tmp_path: Path) -> None:
    """The request in flight ends only once the unload has begun (seen as the name
    refused): the unload returns after it, and the adapter is gone."""
    adapters = _set(tmp_path, 2, ["a"])
    ref = adapters.begin("a")
    refused: list[str] = []

    def the_request() -> None:
        seen = threading.Event()
        for _ in range(6000):  # until the unload refuses the name (at most a minute)
            if "a" not in adapters.names():
                break
            seen.wait(0.01)
        try:
            adapters.begin("a")
        except UnknownAdapter as exc:
            refused.append(str(exc))
        adapters.end(ref)

    thread = threading.Thread(target=the_request)
    thread.start()
    assert adapters.remove("a", timeout=60)
    thread.join(60)
    assert refused == ["a"]
    assert adapters.names() == [] and adapters.counts() == {}
    write_adapter(tmp_path / "a2", 4, seed=20)
    again = adapters.add(adapters.read(tmp_path / "a2", "a"))
    assert again.id != ref.id  # a new adapter under the old name: a new id
    assert adapters.remove("a", timeout=0.0)


def test_an_unload_that_times_out_keeps_refusing_the_name_and_ends_with_its_requests(
        tmp_path: Path) -> None:
    adapters = _set(tmp_path, 1, ["a"])
    ref = adapters.begin("a")
    assert not adapters.remove("a", timeout=0.0)
    with pytest.raises(UnknownAdapter):
        adapters.begin("a")
    assert "a" in adapters.counts()
    adapters.end(ref)  # the last request: the adapter leaves
    assert adapters.counts() == {}


def test_names_are_unique(tmp_path: Path) -> None:
    adapters = _set(tmp_path, 1, ["a"])
    with pytest.raises(ValueError, match="already loaded"):
        adapters.add(adapters.read(tmp_path / "a", "a"))


def test_confinement_follows_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    write_adapter(root / "inside", 4, seed=30)
    write_adapter(outside / "secret", 4, seed=31)
    assert confined(root / "inside", root) == (root / "inside").resolve()
    (root / "link").symlink_to(outside / "secret")
    with pytest.raises(AdapterError, match="outside"):
        confined(root / "link", root)
    with pytest.raises(AdapterError, match="outside"):
        confined(root / ".." / "elsewhere" / "secret", root)
    (root / "files").mkdir()
    (root / "files" / "adapter_config.json").symlink_to(outside / "secret" / "adapter_config.json")
    with pytest.raises(AdapterError, match="outside"):
        confined(root / "files", root)
