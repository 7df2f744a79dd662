"""Checkpoints a run can resume from exactly, written so that a crash never leaves one that looks
complete.

`checkpoint-<step>/` is a Hugging Face folder (weights, config, tokenizer: transformers and the
engine load it as is) plus `trainer_state.pt` (optimizer, scheduler, RNG states of every rank,
data position, step, weight version, the logging window) and a readable `trainer_state.json`.
Everything is written into a hidden staging folder; the marker file `checkpoint_complete` goes
in last, and only then is the folder renamed into place. A folder counts as a checkpoint only
with its marker, so neither a crash mid-write nor one mid-delete can pass for a finished save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_PREFIX = "checkpoint-"
FINAL_DIR = "final"
COMPLETE_MARKER = "checkpoint_complete"
TRAINER_STATE_PT = "trainer_state.pt"
TRAINER_STATE_JSON = "trainer_state.json"
_STAGING = re.compile(r"^\.+(checkpoint-\d+|final)\.partial-\d+")


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


def write_checkpoint(folder: str | Path, save_model: Callable[[Path], None],
                     trainer_state: dict[str, Any] | None = None, summary: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint (or, without `trainer_state`, a model-only folder such as `final/`).

    `save_model(path)` must create `path` as a Hugging Face folder (weights, config, tokenizer).
    The marker is written after everything else and the folder is renamed into place after the
    marker, so any exception on the way leaves no folder named `folder`.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(folder.parent)
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save_model(staging)
        if not staging.is_dir():
            raise RuntimeError(f"save_model did not create {staging}")
        if trainer_state is not None:
            torch.save(trainer_state, staging / TRAINER_STATE_PT)
        if summary is not None:
            (staging / TRAINER_STATE_JSON).write_text(json.dumps(summary, indent=2) + "\n")
        marker = {"time": time.time(), **({"step": summary["step"]} if summary and "step" in summary else {})}
        _write_synced(staging / COMPLETE_MARKER, json.dumps(marker) + "\n")
        _move_into_place(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(staging: Path, folder: Path) -> None:
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        (folder / COMPLETE_MARKER).unlink(missing_ok=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, folder)


def remove_stale_staging(output_dir: Path) -> None:
    """Staging folders left by a process that died mid-save."""
    if not output_dir.is_dir():
        return
    for child in output_dir.iterdir():
        if _STAGING.match(child.name):
            shutil.rmtree(child, ignore_errors=True)


def delete_checkpoint(folder: Path) -> None:
    """Marker first, so a crash halfway through deleting leaves nothing that looks complete."""
    (folder / COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


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
    return torch.load(path, map_location="cpu", weights_only=False)


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
