"""One build of the kernels at a time, whatever starts it: the pinned `ninja` on PATH while torch's builder
runs, and the build folder's lock waited for (or cleared, where the build that took it was killed).
`ops._load` holds both around torch's builder."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def pinned_ninja() -> Iterator[None]:
    """The pinned `ninja` (a dependency) first on PATH while torch's builder runs it. The builder runs
    whichever `ninja` PATH names first, and two of them (the environment's and a system one) each read the
    other's build log as stale and rebuild every object: a minute in each process whose PATH differs (a
    server, a script started with the environment's bin folder first) over a cache another built."""
    try:
        import ninja
    except ImportError:  # the builder then finds a system one, or says it needs one
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


BUILDER_FILE = "builder.pid"  # the process that last started a build here
STALE_LOCK_SECONDS = 900  # a lock with no builder named, older than this, is a killed build's


def wait_for_builder(folder: Path, poll: float = 0.5) -> None:
    """Wait while another process builds into `folder`, and clear the lock a killed build left (torch's
    builder waits on it for ever): stale when the process named in `builder.pid` is gone, or, with no
    process named, when it is older than STALE_LOCK_SECONDS."""
    lock = folder / "lock"
    while lock.exists():
        try:
            pid = int((folder / BUILDER_FILE).read_text())
        except (OSError, ValueError):
            pid = None
        try:
            stale = not _alive(pid) if pid is not None else time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS
        except FileNotFoundError:
            return  # released while we looked
        if stale:
            logger.warning("removing the lock of a kernel build that did not finish (%s)", lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
