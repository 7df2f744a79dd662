"""The raw bytes of each token, and a name for it that never collides with another token's.

Log-probs are reported per token, but a byte-level token can hold part of a UTF-8 character (an emoji
is often two tokens of two bytes each), and such a token decodes to U+FFFD on its own. Reporting that
would give distinct tokens one name (so a `{token: logprob}` map loses entries) and wrong `bytes`.
OpenAI's convention fixes both: `bytes` are the token's own bytes, and a token that is not valid UTF-8
on its own is named after its bytes, `bytes:\\xf0\\x9f`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"  # SentencePiece's visible space


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others
    are shifted to code points from 256 on (the `bytes_to_unicode` table of every byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


def _decoder_types(state: Any) -> set[str]:
    types = {state.get("type", "")}
    for inner in state.get("decoders", []) or []:
        types |= _decoder_types(inner)
    return types


def token_name(raw: bytes) -> str:
    """The token's text when its bytes are valid UTF-8 on their own, else `bytes:\\xNN...`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenBytes:
    """Token id -> the bytes it contributes to the decoded text, for a `tokenizers.Tokenizer`."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        decoder = backend.decoder
        self.decoder_types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self.added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._compute(int(token_id))
        return raw

    def _compute(self, token_id: int) -> bytes:
        if token_id in self.added:  # added tokens are stored as plain text, whatever the decoder
            return self.added[token_id].encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if "ByteLevel" in self.decoder_types:
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if "ByteFallback" in self.decoder_types and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if _METASPACE in piece:
            return piece.replace(_METASPACE, " ").encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
