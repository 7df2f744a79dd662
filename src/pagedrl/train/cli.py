"""`pagedrl sft|rm|dpo|grpo|ppo [config.yaml] [key=value ...]`: config file plus overrides, then
the algorithm's `run_<name>(config)`.

Each algorithm is named here by module, run function and config class, and imported only when
asked for, so `pagedrl sft` does not pay for importing GRPO's engine.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from pagedrl.train import config as config_module

# name -> (module, run function, config class); the module imports its config class
ALGORITHMS: dict[str, tuple[str, str, str]] = {
    "sft": ("pagedrl.train.algorithms.sft", "run_sft", "SFTConfig"),
    "rm": ("pagedrl.train.algorithms.rm", "run_rm", "RewardConfig"),
    "dpo": ("pagedrl.train.algorithms.dpo", "run_dpo", "DPOConfig"),
    "grpo": ("pagedrl.train.algorithms.grpo", "run_grpo", "GRPOConfig"),
    "ppo": ("pagedrl.train.algorithms.ppo", "run_ppo", "PPOConfig"),
}

USAGE = """usage: pagedrl {name} [config.yaml] [key=value ...]

Trains with the fields of {cls} (TRL's names), read from the YAML file and then from the
key=value overrides, which win. Example:
  pagedrl {name} config.yaml learning_rate=1e-5 output_dir=runs/x max_steps=100
"""


def split_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """The YAML path (first argument without '=', if any) and the overrides."""
    args = list(argv)
    yaml_path = None
    if args and "=" not in args[0]:
        yaml_path = args.pop(0)
    stray = [a for a in args if "=" not in a]
    if stray:
        raise ValueError(f"command line: {stray[0]!r} is not of the form key=value "
                         "(only the first argument may be a config file)")
    return yaml_path, args


def train_main(algorithm_name: str, argv: Sequence[str]) -> int:
    """Entry point for `pagedrl <algorithm>`; returns the process exit code."""
    if algorithm_name not in ALGORITHMS:
        print(f"pagedrl: unknown algorithm {algorithm_name!r}; choose from {', '.join(ALGORITHMS)}", file=sys.stderr)
        return 2
    module_name, run_name, cls_name = ALGORITHMS[algorithm_name]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(name=algorithm_name, cls=cls_name))
        return 0
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name)
    try:
        yaml_path, overrides = split_args(argv)
        config = config_module.load_config(cls, yaml_path, overrides)
    except ValueError as e:
        print(f"pagedrl {algorithm_name}: error: {e}", file=sys.stderr)
        return 2
    from pagedrl.train.distributed import DistInfo, shutdown

    try:
        final = getattr(module, run_name)(config)
    except ValueError as e:
        print(f"pagedrl {algorithm_name}: error: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            shutdown(DistInfo(world_size=dist.get_world_size()))
    if os.environ.get("RANK", "0") == "0":
        print(f"pagedrl {algorithm_name}: final model in {final}")
    return 0
