"""Folders that appear whole or not at all: written under a hidden sibling name, then renamed.

A model folder, a checkpoint or a GGUF conversion is many files; a crash, a Ctrl-C or a full disk
halfway through must never leave something under the final name that a loader would take for the
real thing. So every such folder is written into `.<name>.partial-<pid>-<random>` beside its
target and published with one `rename`, which POSIX makes atomic within a filesystem. Replacing
an existing folder moves the old one aside to `.<name>.old-…` first; deleting one renames it to
`.<name>.deleting-…` before removing its files, so a crash mid-delete leaves a hidden leftover, not
a half-emptied folder under its real name. `remove_hidden_leftovers` sweeps all three kinds, and
puts a moved-aside folder back where a crash came before its replacement was renamed in.

A rename survives a process's death, not a power loss: the filesystem may put the rename on disk
before the files' data. So every file and folder of the staging folder is fsynced before the rename,
and the parent after it; a folder seen under its name after a reboot holds its whole contents.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# `.tmp-` is the staging name earlier versions used; swept too.
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old|deleting|tmp)-[A-Za-z0-9_-]+$")


def _hidden_sibling(target: Path, kind: str) -> Path:
    """A fresh empty folder `.<name>.<kind>-<pid>-<random>` beside `target`, readable by others
    (mkdtemp's 0700 would make a published model private to this user)."""
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-{os.getpid()}-", dir=target.parent))
    path.chmod(0o755)
    return path


def new_staging_folder(target: str | Path) -> Path:
    """An empty hidden folder beside `target` to write its contents into (parents are created)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return _hidden_sibling(target, "partial")


def _fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entries are what a rename or a new file changes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
        # some filesystems refuse fsync on a folder; their entries are then as durable as they get
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """Put every file under `folder`, and the folders themselves, on disk (files first, so a
    folder's entries never reach the disk ahead of the data they name)."""
    folders = []
    for root, _dirs, files in os.walk(folder):
        folders.append(Path(root))
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                _fsync_path(path)
    for path in reversed(folders):
        _fsync_path(path)


def publish_folder(staging: Path, target: Path, replace: bool = True) -> None:
    """Rename a finished staging folder to `target`, its contents on disk first and the rename
    after. An existing `target` is moved aside and removed when `replace`, else it stays and this
    raises FileExistsError (another writer won)."""
    sync_tree(staging)
    _publish(staging, target, replace)
    _fsync_path(target.parent)


def _publish(staging: Path, target: Path, replace: bool) -> None:
    if target.exists():
        if not replace:
            raise FileExistsError(f"{target}: already exists (written concurrently)")
        aside = _hidden_sibling(target, "old")
        try:
            os.replace(target, aside / "previous")
        except BaseException:
            shutil.rmtree(aside, ignore_errors=True)  # nothing moved: the empty folder aside goes
            raise
        try:
            os.replace(staging, target)
        except BaseException:
            os.replace(aside / "previous", target)  # the old folder back under its name
            shutil.rmtree(aside, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return
    try:
        os.rename(staging, target)  # never over a folder another process published meanwhile
    except OSError:
        if target.exists():
            raise FileExistsError(f"{target}: already exists (written concurrently)") from None
        raise


@contextmanager
def staged_folder(target: str | Path, replace: bool = True) -> Iterator[Path]:
    """`with staged_folder(target) as tmp:` write into `tmp`; on leaving the block it becomes
    `target`. Any exception (KeyboardInterrupt included) removes `tmp` and leaves `target` as it was."""
    target = Path(target)
    staging = new_staging_folder(target)
    try:
        yield staging
        publish_folder(staging, target, replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def discard_folder(folder: Path) -> None:
    """Delete a folder so that no crash leaves it half-deleted under its own name: rename it to a
    hidden `.deleting` sibling first, then remove the files."""
    if not folder.exists():
        return
    aside = _hidden_sibling(folder, "deleting")
    os.replace(folder, aside / folder.name)
    shutil.rmtree(aside, ignore_errors=True)


def remove_hidden_leftovers(parent: str | Path) -> list[Path]:
    """Remove the hidden staging, moved-aside and being-deleted folders of `parent` that a process
    which died mid-write or mid-delete left behind; returns what was removed. Call it only where no
    other process is writing (a run's own output folder)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for child in sorted(parent.iterdir()):
        match = LEFTOVER.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            target, previous = parent / match["name"], child / "previous"
            if match["kind"] == "old" and previous.is_dir() and not target.exists():
                # died between moving the old folder aside and renaming its replacement in:
                # the old one, complete, goes back under its name
                os.replace(previous, target)
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed
