"""A Hugging Face Hub cache written in huggingface_hub's own layout, without a network:
`models--org--name/{blobs,snapshots/<commit>,refs}` with snapshot files as relative symlinks to
content-addressed blobs, as `hf download` leaves it. Tests check the layout with the library's own
`scan_cache_dir` before relying on it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def commit_hash(seed: str) -> str:
    return hashlib.sha1(seed.encode()).hexdigest()  # 40 hex digits, as a git commit id


def cache_snapshot(hub: Path, repo_id: str, files: dict[str, Path], commit: str,
                   refs: Iterable[str] = ("main",)) -> Path:
    """Put `files` (name in the repository -> file on disk) into `hub` as revision `commit` of
    `repo_id`, pointed at by each ref (a branch or tag); returns the snapshot folder."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    """Every file of a model folder, by its name relative to the folder."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
