"""The architecture registry: one module per model family, looked up by name.

As vLLM's model registry does, the built-in families are listed by module path and
imported on first use, so this registry (and model/config.py, which checks every config
against it) stays importable without torch. Adding a family is one module with an
:class:`~model.architectures.base.Architecture` subclass and one line in ``BUILT_IN``
(or a call to :func:`register`, as a test or a plug-in would do).

Lookups by ``GPTConfig.arch``, by a Hugging Face ``model_type`` and by a GGUF
``general.architecture``; an unknown name gets one error listing the registered ones.
"""

from __future__ import annotations

import importlib

from model.architectures.base import Architecture

# GPTConfig.arch → the module whose ARCHITECTURE implements it.
BUILT_IN = {"gpt": "model.architectures.gpt2", "llama": "model.architectures.llama"}
_loaded: dict[str, Architecture] = {}


class UnknownArchitecture(ValueError):
    """No registered architecture has this name (the message lists the ones there are)."""


def register(arch: Architecture) -> Architecture:
    """Make ``arch`` available under ``arch.name`` (replacing a registration of that name)."""
    _loaded[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    """Forget a registration made with :func:`register` (tests clean up with it)."""
    _loaded.pop(name, None)


def architecture_names() -> tuple[str, ...]:
    """Every registered GPTConfig.arch, built-in ones first; imports nothing."""
    return tuple(dict.fromkeys([*BUILT_IN, *_loaded]))


def architecture(name: str) -> Architecture:
    """The architecture called ``name``, importing a built-in one on first use."""
    if name not in _loaded and name in BUILT_IN:
        module = importlib.import_module(BUILT_IN[name])
        _loaded[name] = module.ARCHITECTURE
    if name not in _loaded:
        raise UnknownArchitecture(f"unknown architecture {name!r}; registered: "
                                  f"{', '.join(architecture_names())}")
    return _loaded[name]


def all_architectures() -> list[Architecture]:
    return [architecture(name) for name in architecture_names()]


def for_hf_model_type(model_type: str) -> Architecture | None:
    """The architecture importing config.json's ``model_type``, or None."""
    return next((a for a in all_architectures() if model_type in a.hf_model_types), None)


def for_gguf(name: str) -> Architecture | None:
    """The architecture importing GGUF files of ``general.architecture`` ``name``, or None."""
    return next((a for a in all_architectures() if name in a.gguf_names), None)


def hf_model_types() -> list[str]:
    return [t for a in all_architectures() for t in a.hf_model_types]


def gguf_names() -> list[str]:
    return [n for a in all_architectures() for n in a.gguf_names]
