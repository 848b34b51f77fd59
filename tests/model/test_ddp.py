"""Two CPU processes under torchrun (gloo): both ranks end with identical weights.

Each rank samples different windows (the batch depends on the rank), so identical weights
can only come from DistributedDataParallel averaging the gradients; a debug option makes
every rank save the weights it holds, and rank 0's checkpoint must match them too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint
from model.train import TrainOptions, train

BIN = Path(sys.executable).parent


def test_two_process_ddp_keeps_ranks_identical(tmp_path, stdlib_text):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(stdlib_text[:20_000], encoding="utf-8")
    torchrun = shutil.which("torchrun", path=str(BIN))
    attnserve = shutil.which("attnserve", path=str(BIN))
    assert torchrun and attnserve
    args = ["train", "--data", str(corpus), "--preset", "tiny", "--tokenizer", "char",
            "--context", "32", "--batch-size", "4", "--steps", "5", "--seed", "3",
            "--eval-tokens", "128", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "--no-python", attnserve, *args,
         "--out", str(tmp_path / "ddp"), "--dump-rank-weights", str(tmp_path / "ranks")],
        capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rank0 = load_file(str(tmp_path / "ranks" / "rank0.safetensors"))
    rank1 = load_file(str(tmp_path / "ranks" / "rank1.safetensors"))
    ckpt = load_checkpoint(tmp_path / "ddp")
    assert ckpt.meta.training["world_size"] == 2 and ckpt.meta.training["steps"] == 5
    assert rank0.keys() == rank1.keys() == ckpt.model.state_dict().keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
        assert torch.equal(rank0[name], ckpt.model.state_dict()[name]), name

    # The same run in one process sees only rank 0's batches, so it must end elsewhere:
    # the two-process weights really include rank 1's gradients.
    single = train(TrainOptions(out=str(tmp_path / "single"), data=str(corpus), preset="tiny",
                                tokenizer="char", context=32, batch_size=4, steps=5, seed=3,
                                eval_tokens=128, progress=False, verbose=False))
    alone = load_checkpoint(single.out).model.state_dict()
    assert not all(torch.equal(alone[name], rank0[name]) for name in rank0)
