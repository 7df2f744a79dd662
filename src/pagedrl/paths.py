"""Where pagedrl keeps what it makes once and reuses: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PAGEDRL_CACHE_DIR, else $XDG_CACHE_HOME/pagedrl, else ~/.cache/pagedrl."""
    if os.environ.get("PAGEDRL_CACHE_DIR"):
        return Path(os.environ["PAGEDRL_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "pagedrl"
    return Path.home() / ".cache" / "pagedrl"
