"""Two processes under torchrun (gloo, data sharded by rank) give the losses of one process at
the same global batch, and only rank 0 writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_train import arithmetic_rows

from pagedrl.train.algorithms.sft import run_sft
from pagedrl.train.logging import read_metrics
from pagedrl.train.offline_config import SFTConfig

WORKER = Path(__file__).parent / "ddp_sft_worker.py"


def test_two_gloo_processes_match_one_process(tiny_train_model, tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # 2 processes x 2 per micro-batch x 2 accumulation steps = 8 rows per step
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(tiny_train_model), str(tmp_path / "ddp"), "2", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # 1 process x 4 per micro-batch x 2 accumulation steps = the same 8 rows per step
    config = SFTConfig(model=str(tiny_train_model), output_dir=str(tmp_path / "one"), max_steps=3,
                       per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3,
                       logging_steps=1, save_steps=2, seed=0, use_cpu=True)
    run_sft(config, dataset=arithmetic_rows(), progress=False)

    ddp, one = read_metrics(tmp_path / "ddp" / "metrics.jsonl"), read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in ddp] == [r["step"] for r in one] == [1, 2, 3]  # rank 0 alone wrote
    for a, b in zip(ddp, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-4)
        assert a["mean_token_accuracy"] == pytest.approx(b["mean_token_accuracy"], abs=1e-6)
        assert a["num_tokens"] == b["num_tokens"] and a["epoch"] == b["epoch"]
    assert (tmp_path / "ddp" / "checkpoint-2" / "checkpoint_complete").is_file()
    assert (tmp_path / "ddp" / "final" / "model.safetensors").is_file()
    assert "examples per step   8 = 2 per micro-batch x 2 accumulation steps x 2 process(es)" in proc.stdout
