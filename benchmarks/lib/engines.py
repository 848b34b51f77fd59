"""Which file each of our engine rows and each llama.cpp row runs: shared by the harness
and the worker (a leaf module, so the worker imports no torch through it)."""

from __future__ import annotations

# Our engine rows and the artifact (a ``Prepared.paths`` key) each one runs.
ENGINE_ARTIFACTS = {"engine": "artifact", "engine_int8": "artifact_int8",
                    "engine_int4": "artifact_int4", "engine_gguf": "artifact_gguf"}
# llama.cpp rows and the GGUF file each one runs.
LLAMACPP_FILES = {"llamacpp_f32": "gguf_f32", "llamacpp_q8_0": "gguf_q8_0",
                  "llamacpp_q4_1": "gguf_q4_1"}
