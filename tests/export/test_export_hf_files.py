"""A checkpoint's chat template, tokenizer_config.json and generation_config.json travel
into the artifact, pinned by the manifest, and the service reads them from there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from export.to_onnx import export_artifact
from service.artifact.loader import open_artifact
from service.contract import io_spec as io
from service.contract.manifest import sha256_file, verify_manifest
from service.settings import Settings

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"


def test_hf_files_are_copied_pinned_and_loaded(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    (ckpt / io.CHAT_TEMPLATE_FILE).write_text(TEMPLATE, "utf-8")
    (ckpt / io.TOKENIZER_CONFIG_FILE).write_text(json.dumps({"eos_token": "<end>"}), "utf-8")
    (ckpt / io.GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": [2, 7]}),
                                                   "utf-8")
    out = export_artifact(ckpt, tmp_path / "artifact", verify=False)
    manifest = verify_manifest(out)
    for name in io.OPTIONAL_HF_FILES:
        assert (out / name).read_bytes() == (ckpt / name).read_bytes()
        assert manifest.files[name].sha256 == sha256_file(ckpt / name)
    artifact = open_artifact(Settings(model=out))
    assert artifact.chat_template.origin == io.CHAT_TEMPLATE_FILE
    assert artifact.chat_template.render([{"role": "user", "content": "hi"}]) == "<user>hi<end>"
    assert artifact.extra_eos_ids == (7,)


def test_an_artifact_without_them_gets_the_default_template(tiny_artifact: Path) -> None:
    assert not any((tiny_artifact / name).exists() for name in io.OPTIONAL_HF_FILES)
    artifact = open_artifact(Settings(model=tiny_artifact))
    assert artifact.chat_template.origin == "default"
    assert artifact.extra_eos_ids == ()
