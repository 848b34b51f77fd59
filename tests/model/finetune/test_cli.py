"""The command line names what it does: `attnserve --help` and `import --help` list every
family the importers read (checked against the architecture registry, which the help
texts cannot import without torch), and finetune / merge are there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from model.architectures import gguf_names, hf_model_types
from model.cli import FAMILIES, GGUF_FAMILIES

BIN = Path(sys.executable).parent
# transformers' model_type → the family's name in the help texts
DISPLAY = {"gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3",
           "smollm3": "SmolLM3", "mistral": "Mistral", "phi3": "Phi-3",
           "gemma3_text": "Gemma 3"}


def help_of(*argv: str) -> str:
    proc = subprocess.run([str(BIN / "attnserve"), *argv, "--help"], capture_output=True,
                          text=True, timeout=60, check=True)
    return " ".join(proc.stdout.split())  # argparse wraps lines


def test_the_help_texts_list_every_registered_family():
    assert set(DISPLAY) == set(hf_model_types())
    assert set(GGUF_FAMILIES) == set(gguf_names())
    top, imports = help_of(), help_of("import")
    for name in DISPLAY.values():
        assert name in FAMILIES and name in top and name in imports, name
    for name in GGUF_FAMILIES:
        assert name in imports, name
    assert "finetune" in top and "merge" in top


def test_finetune_help_names_the_data_formats_and_defaults():
    text = help_of("finetune")
    for needle in ('{"messages"', '{"prompt", "completion"}', '{"text"}', "--lora-r",
                   "--full", "--resume", "--show-masks", "PEFT"):
        assert needle in text, needle
