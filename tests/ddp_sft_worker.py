"""Run by tests/test_trainer_ddp.py under `torchrun --nproc_per_node 2`: SFT on the tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tiny_train import arithmetic_rows  # noqa: E402

from pagedrl.train.algorithms.sft import run_sft  # noqa: E402
from pagedrl.train.distributed import DistInfo, shutdown  # noqa: E402
from pagedrl.train.offline_config import SFTConfig  # noqa: E402

if __name__ == "__main__":
    model_dir, output_dir, per_device, accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    config = SFTConfig(model=model_dir, output_dir=output_dir, max_steps=3, per_device_train_batch_size=per_device,
                       gradient_accumulation_steps=accumulation, learning_rate=3e-3, logging_steps=1, save_steps=2,
                       seed=0, use_cpu=True)
    run_sft(config, dataset=arithmetic_rows(), progress=False)
    shutdown(DistInfo(world_size=2))
