"""A GGUF file's header as pagedrl reads it: opened with errors that say what is wrong with the file, and
its key/value fields with errors that name the file and the key."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np


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

    def common_fields(self, prefix: str, tensors: dict[str, Any], eps: float, context: int) -> dict[str, Any]:
        """The config.json fields every family reads alike: vocabulary (the embedding's rows), norm
        epsilon, context, tied head (no `output.weight`), special tokens; `eps` and `context` are the
        family's defaults where the file is silent, as llama.cpp's."""
        if "token_embd.weight" not in tensors:
            raise GGUFError(f"{self.source}: tensor 'token_embd.weight' is missing")
        return dict(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            rms_norm_eps=published_float(self.get(prefix + "attention.layer_norm_rms_epsilon", eps)),
            max_position_embeddings=int(self.get(prefix + "context_length", context)),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.get("tokenizer.ggml.padding_token_id"),
            torch_dtype="float32",
        )


def published_float(x: float) -> float:
    """GGUF stores float32; its shortest repr is the value the model was published with (1e-05, not
    9.99e-06)."""
    return float(str(np.float32(x)))


def open_gguf(gguf_path: Path) -> gguf.GGUFReader:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{gguf_path}: not a GGUF file (no 'GGUF' magic at the start)")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as e:
        # A header or tensor table that ends early makes the reader index or reshape past the
        # end of the file; say what that most likely means instead of where numpy noticed.
        size = gguf_path.stat().st_size
        raise GGUFError(f"{gguf_path}: truncated or corrupt GGUF ({size} bytes; reading it failed with "
                        f"{type(e).__name__}: {e}); a partial download? fetch the file again") from None
    split = reader.fields.get("split.count")
    if split is not None and int(split.contents()) > 1:
        number = reader.fields.get("split.no")
        part = f"part {int(number.contents()) + 1} of {int(split.contents())}" if number is not None else "a part"
        raise GGUFError(f"{gguf_path}: {part} of a split GGUF; pagedrl reads one file: join the parts first with "
                        "llama.cpp's `llama-gguf-split --merge <first part> <out>.gguf`")
    return reader
