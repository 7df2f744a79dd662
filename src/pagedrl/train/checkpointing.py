"""Checkpoints a run can resume from exactly, written so that a crash never leaves one that looks
complete.

`checkpoint-<step>/` is a Hugging Face folder (weights, config, tokenizer: transformers and the
engine load it as is) plus `trainer_state.pt` (optimizer, scheduler, RNG states of every rank,
data position, step, weight version, the logging window), `trainer_state.json` in the form of
transformers' `TrainerState` (`TrainerState.load_from_json` reads it: `global_step`, `log_history`,
...) and `pagedrl_state.json`, pagedrl's own summary (step, weight version, world size, config),
which a `TrainerState` cannot hold: it takes no keys of its own. `trainer_state.pt` alone is read
on resume.
Everything is written into a hidden staging folder; the marker file `checkpoint_complete` goes
in last, and only then is the folder renamed into place. A folder counts as a checkpoint only
with its marker, so neither a crash mid-write nor one mid-delete can pass for a finished save.
Rotation renames a checkpoint out of the way before deleting its files, and the next start
removes (and names) whatever a killed process left. A full disk is a `CheckpointWriteError`
naming the checkpoint and the space it needs, checked before the first byte where possible.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedrl.model.staging import discard_folder, remove_hidden_leftovers, staged_folder, sync_tree

CHECKPOINT_PREFIX = "checkpoint-"
FINAL_DIR = "final"
COMPLETE_MARKER = "checkpoint_complete"
TRAINER_STATE_PT = "trainer_state.pt"
TRAINER_STATE_JSON = "trainer_state.json"
PAGEDRL_STATE_JSON = "pagedrl_state.json"
# Logged values that are pagedrl's own clocks, not part of a transformers log row.
_NOT_LOGGED_BY_TRANSFORMERS = ("wall_time", "train_time")


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete `checkpoint-<step>` folders of `output_dir`, oldest step first."""
    out = []
    root = Path(output_dir)
    if not root.is_dir():
        return []
    for child in root.iterdir():
        m = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", child.name)
        if m and child.is_dir() and is_complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume_from_checkpoint: str | bool | None, output_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: None/False for a fresh run, True (or "true"/"latest") for the
    newest complete one in `output_dir`, or a path, which must be a complete checkpoint."""
    value = resume_from_checkpoint
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("", "false", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "latest")):
        found = latest_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"resume_from_checkpoint: no complete checkpoint in {output_dir} to resume from")
        return found
    path = Path(value)
    if not path.is_dir():
        raise ValueError(f"resume_from_checkpoint: {path} is not a folder")
    if not is_complete(path) or not (path / TRAINER_STATE_PT).is_file():
        raise ValueError(f"resume_from_checkpoint: {path} is incomplete (no {COMPLETE_MARKER} marker or "
                         f"{TRAINER_STATE_PT}); a save was interrupted there")
    return path


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, most often); the message names the
    checkpoint, the cause and, for a full disk, the space it needs. Earlier checkpoints are intact."""


def write_checkpoint(folder: str | Path, save_model: Callable[[Path], None],
                     trainer_state: dict[str, Any] | None = None, summary: dict[str, Any] | None = None,
                     size_hint: int = 0, own_summary: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint (or, without `trainer_state`, a model-only folder such as `final/`):
    `summary` becomes `trainer_state.json`, `own_summary` `pagedrl_state.json`.

    `save_model(path)` must create `path` as a Hugging Face folder (weights, config, tokenizer). The marker is written after everything else and the folder
    is renamed into place after the marker, so any exception on the way leaves no folder named
    `folder`. `size_hint` (bytes, a lower bound) lets a disk too full for it fail before writing.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # A run's checkpoints are all about the same size: the last one is the best estimate.
    needed = max(size_hint, folder_bytes(latest_checkpoint(folder.parent)) if trainer_state is not None else 0)
    free = shutil.disk_usage(folder.parent).free
    if needed > free:
        raise CheckpointWriteError(_no_space_message(folder, needed, free))
    try:
        with staged_folder(folder) as tmp:
            tmp.rmdir()  # a fresh unique name; `save_model` creates the folder itself
            save_model(tmp)
            if not tmp.is_dir():
                raise RuntimeError(f"save_model did not create {tmp}")
            if trainer_state is not None:
                torch.save(trainer_state, tmp / TRAINER_STATE_PT)
            if summary is not None:
                (tmp / TRAINER_STATE_JSON).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
            if own_summary is not None:
                (tmp / PAGEDRL_STATE_JSON).write_text(json.dumps(own_summary, indent=2) + "\n")
            sync_tree(tmp)  # the marker must never reach the disk ahead of what it vouches for
            step = (own_summary or summary or {}).get("step")
            marker = {"time": time.time(), **({"step": step} if step is not None else {})}
            _write_synced(tmp / COMPLETE_MARKER, json.dumps(marker) + "\n")
    except Exception as e:
        # The message gives the space free before the write: what is free now still counts the
        # files the failed writer holds open.
        if _is_out_of_space(e, needed, shutil.disk_usage(folder.parent).free):
            raise CheckpointWriteError(_no_space_message(folder, needed, free)) from e
        raise
    return folder


def transformers_log_row(row: dict[str, Any]) -> dict[str, Any]:
    """A logged row as transformers' Trainer keeps it in `log_history`: evaluations' `eval/<name>`
    as `eval_<name>`, without pagedrl's clocks."""
    return {(f"eval_{k[5:]}" if k.startswith("eval/") else k): v for k, v in row.items()
            if k not in _NOT_LOGGED_BY_TRANSFORMERS}


def transformers_trainer_state(global_step: int, epoch: float, max_steps: int, logging_steps: int,
                               eval_steps: int | None, save_steps: int | None, train_batch_size: int,
                               log_history: list[dict[str, Any]], num_train_epochs: int = 0,
                               num_input_tokens_seen: int = 0) -> dict[str, Any]:
    """`trainer_state.json` with exactly the fields of transformers' `TrainerState` (its
    `load_from_json` passes them all to the dataclass, which refuses any other key); the ones pagedrl
    has no counterpart for (flos, best metric, hyper-parameter search) at their defaults."""
    return {"epoch": epoch, "global_step": global_step, "max_steps": max_steps, "logging_steps": logging_steps,
            "eval_steps": eval_steps, "save_steps": save_steps, "train_batch_size": train_batch_size,
            "num_train_epochs": num_train_epochs, "num_input_tokens_seen": num_input_tokens_seen,
            "total_flos": 0, "log_history": [dict(r) for r in log_history], "best_metric": None,
            "best_global_step": None, "best_model_checkpoint": None, "is_local_process_zero": True,
            "is_world_process_zero": True, "is_hyper_param_search": False, "trial_name": None,
            "trial_params": None, "stateful_callbacks": {}}


def folder_bytes(folder: Path | None) -> int:
    """Bytes of the files directly in `folder` (a checkpoint is flat); 0 for None."""
    if folder is None or not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested dict/list/tuple, each storage counted once (tied weights):
    a lower bound on what saving `obj` writes."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def _is_out_of_space(error: BaseException, needed: int, free: int) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception chain, or a writer that hides the errno (torch's
    zip writer says `unexpected pos`, safetensors an I/O error) while less than `needed` is free."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return free < needed


def _no_space_message(folder: Path, needed: int, free: int) -> str:
    earlier = latest_checkpoint(folder.parent)
    kept = f"the checkpoints already saved are intact (latest: {earlier})" if earlier else "no earlier checkpoint"
    # Past the up-front check the estimate was too low: all that is known is that it needs more.
    space = (f"it needs about {_mib(needed)}, {_mib(free)} free" if needed > free
             else f"it needs more than the {_mib(free)} free")
    return f"could not write {folder}: no space left on device ({space} on {folder.parent}); {kept}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def remove_leftovers(output_dir: str | Path) -> list[str]:
    """What a process killed mid-save or mid-rotation left in `output_dir`: hidden staging,
    moved-aside and being-deleted folders, and `checkpoint-<step>` folders without their marker.
    Removes them and returns one line per folder, for the start summary."""
    root = Path(output_dir)
    removed = [f"{p.name} (unfinished write or delete)" for p in remove_hidden_leftovers(root)]
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if (re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", child.name) and child.is_dir() and not is_complete(child)
                    and _only_our_files(child)):
                discard_folder(child)
                removed.append(f"{child.name} (no {COMPLETE_MARKER} marker: an interrupted save or rotation)")
    return removed


# What a checkpoint folder of ours can hold; a `checkpoint-<step>` with anything else (another
# trainer's optimizer.pt, say) was not written here and is never deleted.
_OUR_FILES = re.compile(r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
                        r"model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json|"
                        r"special_tokens_map\.json|chat_template\.jinja|trainer_state\.(pt|json)|pagedrl_state\.json|"
                        r"adapter_config\.json|adapter_model\.safetensors")


def _only_our_files(folder: Path) -> bool:
    return all(p.is_file() and _OUR_FILES.fullmatch(p.name) for p in folder.iterdir())


def delete_checkpoint(folder: Path) -> None:
    """Renamed out of the way first, so a crash halfway through deleting leaves only a hidden
    leftover that the next start removes, never a half-emptied `checkpoint-<step>`."""
    discard_folder(folder)


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `save_total_limit`; `keep` is never deleted."""
    if save_total_limit is None:
        return []
    found = [p for _, p in list_checkpoints(output_dir)]
    excess = len(found) - save_total_limit
    deleted = []
    for path in found:
        if excess <= 0:
            break
        if keep is not None and path.resolve() == keep.resolve():
            continue
        delete_checkpoint(path)
        deleted.append(path)
        excess -= 1
    return deleted


def load_trainer_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / TRAINER_STATE_PT
    if not path.is_file():
        raise ValueError(f"resume_from_checkpoint: {path} is missing")
    # Our own file, holding numpy RNG state and Python objects: not loadable with weights_only.
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"resume_from_checkpoint: {path} cannot be read (truncated or damaged?): {first}") from None


# ---------------------------------------------------------------------------------------------
# Random number generators
# ---------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's generators: Python, numpy, torch CPU and (if present) CUDA."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
