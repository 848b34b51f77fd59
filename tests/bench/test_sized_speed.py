"""benchmarks/sized_speed.py: reading llama-batched-bench's table, and refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.sized_speed import Speeds, batched_bench_speeds

REPO = Path(__file__).resolve().parents[2]

# llama-batched-bench's own output (llama.cpp from llama-cpp-python 0.3.36's sdist, the
# shipped SmolLM2 Q4_1 file, -npp 8 -ntg 4 -npl 1,2 -t 2), its log lines before the table
OUTPUT = """
llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, \
is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    1 |     12 |    0.069 |   116.16 |    0.067 |    60.01 |    0.136 |    88.54 |
|     8 |      4 |    2 |     24 |    0.205 |    78.05 |    0.422 |    18.95 |    0.627 |    38.26 |
"""


def test_the_prompt_and_generation_columns_are_read_per_batch() -> None:
    assert batched_bench_speeds(OUTPUT) == {1: Speeds(prefill=116.16, decode=60.01),
                                            2: Speeds(prefill=78.05, decode=18.95)}
    assert batched_bench_speeds("no table here\n|  PP | TG |\n") == {}


def test_a_missing_file_is_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.sized_speed", "--gguf",
                           str(tmp_path / "none.gguf"), "--artifact", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"sized_speed: {tmp_path / 'none.gguf'} is not a file"]


def test_bytes_a_token_leave_out_an_untied_embedding(tmp_path: Path) -> None:
    """The batch-1 bound's bytes: every tensor a token reads, the whole embedding only where
    it is also the output head (tied); the sizes are those of the arrays written."""
    import numpy as np
    from gguf import GGUFWriter

    from benchmarks.sized_speed import bytes_a_token

    arrays = {"token_embd.weight": np.ones((40, 32), np.float32),
              "blk.0.attn_q.weight": np.ones((32, 32), np.float16),
              "output_norm.weight": np.ones(32, np.float32)}
    for untied in (False, True):
        path = tmp_path / f"untied-{untied}.gguf"
        writer = GGUFWriter(path, "llama")
        tensors = {**arrays, **({"output.weight": np.ones((40, 32), np.float16)} if untied
                                else {})}
        for name, array in tensors.items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        read = sum(a.nbytes for name, a in tensors.items()
                   if not (untied and name == "token_embd.weight"))
        assert bytes_a_token(path) == read
