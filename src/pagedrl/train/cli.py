"""`pagedrl sft|rm|dpo|kto|grpo|rloo|ppo|distill [config.yaml] [key=value ...]`: config file plus overrides, then
the algorithm's `run_<name>(config)`.

Each algorithm is named here by module, run function and config class, and imported only when
asked for, so `pagedrl sft` does not pay for importing GRPO's engine.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from collections.abc import Sequence

from pagedrl.train import config as config_module

# name -> (module, run function, config class); the module imports its config class
ALGORITHMS: dict[str, tuple[str, str, str]] = {
    "sft": ("pagedrl.train.algorithms.sft", "run_sft", "SFTConfig"),
    "rm": ("pagedrl.train.algorithms.rm", "run_rm", "RewardConfig"),
    "dpo": ("pagedrl.train.algorithms.dpo", "run_dpo", "DPOConfig"),
    "kto": ("pagedrl.train.algorithms.kto", "run_kto", "KTOConfig"),
    "grpo": ("pagedrl.train.algorithms.grpo", "run_grpo", "GRPOConfig"),
    "rloo": ("pagedrl.train.algorithms.rloo", "run_rloo", "RLOOConfig"),
    "ppo": ("pagedrl.train.algorithms.ppo", "run_ppo", "PPOConfig"),
    "distill": ("pagedrl.train.algorithms.distill", "run_distill", "DistillationConfig"),
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
    from pagedrl.train.checkpointing import CheckpointWriteError
    from pagedrl.train.distributed import DistInfo, shutdown
    from pagedrl.train.interrupt import TrainingInterrupted

    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        final = getattr(module, run_name)(config)
    except TrainingInterrupted as e:
        if main_rank:
            print(resume_hint(algorithm_name, argv, e), file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        if main_rank:
            print(f"pagedrl {algorithm_name}: stopped at once; nothing saved since the last checkpoint",
                  file=sys.stderr)
        return 130
    except (ValueError, CheckpointWriteError) as e:
        print(f"pagedrl {algorithm_name}: error: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            shutdown(DistInfo(world_size=dist.get_world_size()))
    if main_rank:
        print(f"pagedrl {algorithm_name}: final model in {final}")
    return 0


def resume_command(algorithm_name: str, argv: Sequence[str], checkpoint: str | os.PathLike) -> str:
    """The command line that continues this run from `checkpoint`: the same arguments, with
    `resume_from_checkpoint` set to it (replacing any earlier value), quoted for a POSIX shell;
    under torchrun, launched the same way on one node (more nodes: your own launcher line)."""
    kept = [a for a in argv if a.partition("=")[0].strip() != "resume_from_checkpoint"]
    world = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    launcher = ["torchrun", "--nproc_per_node", world, "-m", "pagedrl.cli"] if world and world != "1" else ["pagedrl"]
    words = [*launcher, algorithm_name, *kept, f"resume_from_checkpoint={os.path.abspath(checkpoint)}"]
    return " ".join(shlex.quote(w) for w in words)


def resume_hint(algorithm_name: str, argv: Sequence[str], stopped: KeyboardInterrupt) -> str:
    """What to tell the user after an interrupted run: how to resume, or that nothing was saved."""
    checkpoint = getattr(stopped, "checkpoint", None)
    if checkpoint is None:
        return f"pagedrl {algorithm_name}: {stopped}; run the same command to start again"
    return f"pagedrl {algorithm_name}: to resume, run:\n  {resume_command(algorithm_name, argv, checkpoint)}"
