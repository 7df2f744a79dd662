"""GGUF files with a SentencePiece tokenizer (`tokenizer.ggml.model` "llama": Llama 2, Mistral 7B,
TinyLlama): pieces and scores, no merges. A vocabulary trained here as SentencePiece's BPE, written as
llama.cpp's converter writes one (control, unknown and byte tokens, a score a piece, best merges
first), read back: the same ids as transformers' tokenizer of the same GGUF and as the trained
tokenizer itself, byte fallback for what no piece spells, and decoding that gives the text back."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import transformers
from gguf_files import TINY, write_tiny_gguf
from tiny import hf_model
from tokenizers import SentencePieceBPETokenizer

from pagedrl.model.gguf import convert_gguf
from pagedrl.model.tokenizer import Tokenizer

CORPUS = ["the cat sat on the mat", "a cat and a hat", "the rain in spain stays mainly in the plain",
          "hello world, hello there", "tokens and pieces of the text", "then the others came in"] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
TEXTS = ["the cat sat on the mat", "Hello world", "  two leading spaces", "the\nnew line", "héllo wörld 🐈",
         "ÆØÅ and ß", "end with space ", "", "<s> is text here", "x"]


def train_pieces() -> SentencePieceBPETokenizer:
    """SentencePiece's BPE trained on CORPUS (120 pieces): the vocabulary these tests write into GGUFs."""
    spm = SentencePieceBPETokenizer(add_prefix_space=True)
    spm.train_from_iterator(CORPUS, vocab_size=120, min_frequency=2, special_tokens=SPECIALS, show_progress=False)
    return spm


@pytest.fixture(scope="module")
def trained() -> SentencePieceBPETokenizer:
    return train_pieces()


def sentencepiece_vocabulary(spm: SentencePieceBPETokenizer):
    """The trained vocabulary as llama.cpp writes a SentencePiece one: <unk>, <s>, </s>, the 256 byte
    tokens, then the pieces, each scored minus its rank (the first learned merge is the best)."""
    pieces = [t for t, _ in sorted(spm.get_vocab().items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    tokens = SPECIALS + BYTES + pieces
    types = [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)] \
        + [int(gguf.TokenType.BYTE)] * 256 + [int(gguf.TokenType.NORMAL)] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]

    def write(w: gguf.GGUFWriter) -> None:
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_space_prefix(True)

    return tokens, write


@pytest.fixture(scope="module")
def spm_gguf(trained, tmp_path_factory) -> tuple[Path, list[str]]:
    tokens, vocabulary = sentencepiece_vocabulary(trained)
    folder = tmp_path_factory.mktemp("spm")
    model = hf_model(dict(TINY, vocab_size=len(tokens), bos_token_id=1, eos_token_id=2), seed=2)
    return write_tiny_gguf(folder / "spm.gguf", model, tokenizer_model="llama", vocabulary=vocabulary), tokens


def test_ids_equal_transformers_and_the_trained_tokenizer(spm_gguf, trained, tmp_path: Path) -> None:
    path, tokens = spm_gguf
    ours = Tokenizer.from_folder(convert_gguf(path, tmp_path / "hf"))
    direct = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[:1] == [1]  # the file asks for BOS
        # transformers' Metaspace takes a text's own first space for the prefix and puts none after a control
        # token; llama.cpp puts one before every stretch of text, as the models' tokenizer.json normalizers do
        if not text.startswith(" ") and "<s>" not in text:
            assert ids == direct.encode(text), text
            assert ours.decode(ids, True) == direct.decode(ids, skip_special_tokens=True), text
        if "<s>" not in text:  # (a control token in the text is one, and skipped)
            assert ours.decode(ids, True) == text, text
    # llama.cpp's prefix: a space before the text, whatever it starts with, as the models' tokenizer.json
    for text, spelled in (("  two", "\u2581\u2581\u2581two"), ("<s> is", "<s>\u2581\u2581is")):
        assert "".join(ours.id_to_token(i) for i in ours.encode(text, add_special_tokens=False)) == spelled
    # Where every character has a piece, the ids are the trained tokenizer's pieces (offset in the file)
    for text in CORPUS[:6]:
        want = [tokens.index(trained.id_to_token(i)) for i in trained.encode(text).ids]
        assert ours.encode(text, add_special_tokens=False) == want, text
    # A character no piece spells falls back to its UTF-8 bytes
    assert ours.encode("🐈", add_special_tokens=False)[-4:] == [3 + b for b in "🐈".encode()]


def test_the_converted_folder_carries_what_the_model_needs(spm_gguf, tmp_path: Path) -> None:
    path, _ = spm_gguf
    out = convert_gguf(path, tmp_path / "hf")
    ours = Tokenizer.from_folder(out)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(spm_gguf[1])
