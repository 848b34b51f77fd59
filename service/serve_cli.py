"""`attnserve serve`: serve an exported artifact over HTTP.

Usage:
    attnserve serve --model artifacts/default [--host 127.0.0.1] [--port 8000]
                    [--device auto|cpu|cuda] [--max-batch-size 32] ...

Every flag is a field of service/settings.py's ``Settings``, generated from it: the flag is
the field's name with dashes, its help the field's description and default, its type and
choices the field's; and every field is also an environment variable (--max-batch-size is
ATTNSERVE_MAX_BATCH_SIZE). Flags given on the command line win over the environment.
``api_key`` is the one field without a flag: a secret on a command line is visible to
every user of the machine (``ps``), so it is read from ATTNSERVE_API_KEY only.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any

ENVIRONMENT_ONLY = frozenset({"api_key"})


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def argument(field: Any) -> dict[str, Any]:
    """argparse keywords for one pydantic field (``FieldInfo``): its type (None dropped
    from an optional one), choices for a Literal, --x/--no-x for a bool, and help text of
    its description and default. The default itself stays unset (None): Settings applies
    it, after the environment."""
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    text = field.description or ""
    default = field.get_default()
    keywords: dict[str, Any] = {"default": None}
    if typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    if kind is bool:
        keywords["action"] = argparse.BooleanOptionalAction
        shown = "on" if default else "off"
    elif typing.get_origin(kind) is tuple:  # NAME=DIR [NAME=DIR ...]
        keywords["nargs"] = "+"
        shown = "none" if not default else " ".join(default)
    elif typing.get_origin(kind) is typing.Literal:
        keywords["choices"] = list(typing.get_args(kind))
        shown = default
    else:
        keywords["type"] = str if kind is Path else kind
        shown = default
    if default is not None and not field.is_required():
        text = f"{text} (default {shown})" if text else f"default {shown}"
    keywords["help"] = text.replace("%", "%%")
    return keywords


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve an exported model over HTTP (FastAPI + ONNX Runtime)",
        description="Serve an artifact directory with continuous batching. Every option "
                    "can also be set as ATTNSERVE_<OPTION> in the environment (and the API "
                    "key only there: ATTNSERVE_API_KEY).")
    try:
        from service.settings import Settings
    except ImportError:  # an install without the serve extra: the command says so when run
        parser.set_defaults(handler=_not_installed)
        return
    # the required --model first (Settings declares it last, after the options it adds to)
    for name, field in sorted(Settings.model_fields.items(), key=lambda f: not f[1].is_required()):
        if name not in ENVIRONMENT_ONLY:
            parser.add_argument(flag(name), dest=name, **argument(field))
    parser.set_defaults(handler=run)


def _not_installed(args: argparse.Namespace) -> int:
    raise ValueError("attnserve serve needs the serve extra: pip install 'attnserve[serve]'")


def settings_from(args: argparse.Namespace) -> Any:
    """``Settings`` from the flags given (they win), then ATTNSERVE_* in the environment,
    then each field's default; a ValueError naming the first invalid or missing one."""
    from pydantic import ValidationError

    from service.settings import Settings

    overrides = {name: getattr(args, name) for name in Settings.model_fields
                 if getattr(args, name, None) is not None}
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        if first["type"] == "missing":
            raise ValueError(f"{flag(name)} (or ATTNSERVE_{name.upper()}) is required"
                             ) from None
        raise ValueError(f"invalid setting {name}: {first['msg']}") from None


def run(args: argparse.Namespace) -> int:
    from service.artifact.loader import open_artifact

    settings = settings_from(args)
    artifact = open_artifact(settings)
    if settings.serves_adapters:
        check_adapters(settings, artifact.path)
    check_control_vectors(settings, artifact.config, artifact.path)

    from service.server import serve

    return serve(settings, artifact)


def check_control_vectors(settings: Any, config: Any, artifact_dir: Path) -> None:
    """Every ``--control-vectors`` file read and checked against the model (its width, its
    layers) before the server starts, and the graph that will run checked to take
    ``steer``: the first that does not fit stops it with one line (the engine reads them
    again when it loads)."""
    from service.contract.control_vector import read_control_vector
    from service.contract.engine_spec import STEER
    from service.contract.graphs import GraphTable
    from service.contract.manifest import load_manifest
    from service.engine.control_vectors import control_entries
    from service.viz.graph_cut import graph_input_shapes

    entries = control_entries(settings.control_vectors)
    if not entries and not settings.runtime_control_vectors:
        return
    if not settings.engine_graph or settings.device == "cuda":
        raise ValueError("control vectors are applied by the engine graph on the CPU: drop "
                         "--no-engine-graph / --device cuda")
    graph = GraphTable.of(load_manifest(artifact_dir)).served(
        engine_graph=True, mixed_steps=settings.mixed_steps, on_cuda=False,
        adapters=settings.serves_adapters)[0]
    if STEER not in graph_input_shapes((artifact_dir / graph.file).read_bytes()):
        raise ValueError(f"{graph.file} takes no {STEER} input: export the artifact again "
                         "(with its engine graphs) to serve control vectors")
    for name, path in entries:
        try:
            read_control_vector(path, config.d_model, config.n_layers)
        except OSError as exc:
            raise ValueError(f"--control-vectors {name}: {exc}") from None


def check_adapters(settings: Any, artifact_dir: Path) -> None:
    """Every ``--lora-modules`` adapter read and checked against the artifact's adapter graph
    (its modules, their widths, the rank per slot) before the server starts: the first that
    does not fit stops it with one line (the engine reads them again when it loads)."""
    from service.contract.graphs import GraphTable
    from service.contract.manifest import load_manifest
    from service.engine.adapters import adapter_widths, lora_entries, read_adapter_weights
    from service.viz.graph_cut import graph_input_shapes

    graph = GraphTable.of(load_manifest(artifact_dir)).served(
        engine_graph=settings.engine_graph, mixed_steps=settings.mixed_steps,
        on_cuda=settings.device == "cuda", adapters=True)[0]
    widths = adapter_widths(graph_input_shapes((artifact_dir / graph.file).read_bytes()))
    for name, directory in lora_entries(settings.lora_modules):
        read_adapter_weights(directory, name, widths, settings.max_lora_rank)
