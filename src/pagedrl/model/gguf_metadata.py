"""A GGUF file's header as pagedrl reads it: opened with errors that say what is wrong with the file, and
its key/value fields with errors that name the file and the key."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf


class GGUFError(ValueError):
    """A GGUF file pagedrl cannot convert; the message names the file and the field or tensor."""


class Metadata:
    """Typed access to a GGUF's key/value fields with errors that name the file and the key."""

    def __init__(self, reader: gguf.GGUFReader, source: str) -> None:
        self.reader, self.source = reader, source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.source}: metadata field {key!r} is missing")
        return value


def open_gguf(gguf_path: Path) -> gguf.GGUFReader:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{gguf_path}: not a GGUF file (no 'GGUF' magic at the start)")
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as e:
        # A header or tensor table that ends early makes the reader index or reshape past the
        # end of the file; say what that most likely means instead of where numpy noticed.
        size = gguf_path.stat().st_size
        raise GGUFError(f"{gguf_path}: truncated or corrupt GGUF ({size} bytes; reading it failed with "
                        f"{type(e).__name__}: {e}); a partial download? fetch the file again") from None
