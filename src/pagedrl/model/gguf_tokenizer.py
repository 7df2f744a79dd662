"""A GGUF's tokenizer (arrays of tokens, merges and token types, and the name of llama.cpp's pre-tokenizer
split) rebuilt as the `tokenizers` pipeline of the model's original tokenizer.json."""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pagedrl.model.gguf_metadata import GGUFError, Metadata
from pagedrl.model.tokenizer import Tokenizer

# How llama.cpp's `tokenizer.ggml.pre` splits text before BPE, rebuilt as `tokenizers` pre-tokenizers.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (Phi-4-mini, gpt-oss): case-aware words with their contractions, numbers of up to three digits.
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3's tokenizer.json: digits in threes, CJK runs, then words, punctuation and spaces, one
# split after another.
_DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                     "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                     "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
# Kimi K2's `tokenization_kimi.py`: o200k's split with Han runs first and taken out of the letter classes.
_KIMI_K2_SPLIT = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
                  r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
                  r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Each family's regexes, applied in turn (an "isolated" Split each), before the byte-level mapping.
_SPLITS = {"llama3": (_LLAMA3_SPLIT,), "qwen2": (_QWEN2_SPLIT,), "gpt-4o": (_GPT4O_SPLIT,),
           "deepseek-v3": _DEEPSEEK3_SPLITS, "kimi-k2": (_KIMI_K2_SPLIT,)}
_GEMMA = ("gemma", "gemma2", "gemma3")  # SentencePiece vocabularies read as transformers reads Gemma's
_PRE_TOKENIZER_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2",  # old files without the field: GPT-2's split, as transformers assumes
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3",
    "qwen2": "qwen2", "gpt-4o": "gpt-4o", "deepseek-v3": "deepseek-v3", "kimi-k2": "kimi-k2",
}



def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _pre_tokenizer(pre: str, source: str) -> tuple[Any, Any, bool]:
    """(pre-tokenizer, normalizer, ignore_merges) as the model's original tokenizer.json has them."""
    family = _PRE_TOKENIZER_FAMILIES.get(pre)
    if family == "gpt2":
        return _byte_level(True), None, False
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)]), None, False
    if family in _SPLITS:
        splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _SPLITS[family]]
        seq = pre_tokenizers.Sequence([*splits, _byte_level(False)])
        return seq, (normalizers.NFC() if family == "qwen2" else None), family == "llama3"
    raise GGUFError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported; "
                    f"supported: {', '.join(sorted(_PRE_TOKENIZER_FAMILIES))}")


def read_tokenizer(meta: Metadata) -> Tokenizer:
    model = meta.need("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise GGUFError(f"{meta.source}: tokenizer.ggml.model {model!r} is not supported; supported: 'gpt2' "
                        "(byte-level BPE), 'llama' (SentencePiece BPE)")
    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{meta.source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    gemma = model == "llama" and meta.get("general.architecture") in _GEMMA
    if gemma:  # (llama.cpp's converter writes Gemma's runs of "\u2581" as runs of spaces)
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    backend = _byte_level_bpe(meta, tokens) if model == "gpt2" else _sentencepiece_bpe(meta, tokens, gemma)
    # Control tokens (<|im_start|>) are special; user-defined ones (<think>) are matched whole but kept
    # in decoded text. Both must be added tokens or BPE would cut them into pieces.
    backend.add_tokens([AddedToken(t, special=(k == gguf.TokenType.CONTROL), normalized=False)
                        for t, k in zip(tokens, types, strict=True)
                        if k in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    specials = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    # Without the key, llama.cpp's default: BOS for SentencePiece vocabularies and Llama 3's BPE, none otherwise.
    bos_by_default = model == "llama" or meta.get("tokenizer.ggml.pre") in ("llama3", "llama-v3", "llama-bpe")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_by_default)) and specials["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and specials["eos_token"] is not None
    backend.post_processor = post_processor(specials["bos_token"] if add_bos else None,
                                            specials["eos_token"] if add_eos else None, backend, model == "gpt2")
    templates: dict[str, str] = {}
    for key in meta.reader.fields:
        if key == "tokenizer.chat_template":
            templates["default"] = meta.get(key)
        elif key.startswith("tokenizer.chat_template."):
            templates[key.removeprefix("tokenizer.chat_template.")] = meta.get(key)
    chat_template = templates.get("default") if list(templates) in (["default"], []) else templates
    config = {"add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
              "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048))}
    return Tokenizer(backend, special_tokens=specials, chat_template=chat_template, config=config)


def _merges(meta: Metadata) -> list[tuple[str, ...]]:
    merges = [tuple(m.split(" ")) for m in meta.need("tokenizer.ggml.merges")]
    bad = next((" ".join(m) for m in merges if len(m) != 2), None)
    if bad is not None:
        raise GGUFError(f"{meta.source}: tokenizer.ggml.merges entry {bad!r} is not two tokens separated by a space")
    return merges


def _byte_level_bpe(meta: Metadata, tokens: list[str]) -> BackendTokenizer:
    """GPT-2's byte-level BPE (Llama 3, Qwen, SmolLM2): the file's merges, its pre-tokenizer's split."""
    pre, normalizer, ignore_merges = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), meta.source)
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(meta),
                                          fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: Metadata, tokens: list[str], by_position: bool = False) -> BackendTokenizer:
    """SentencePiece's BPE (Llama 2, Mistral 7B, TinyLlama, Phi-3): spaces as "▁", one prepended to the
    text (unless `tokenizer.ggml.add_space_prefix` is false), pieces merged best score first, a byte
    with no piece of its own spelled as its <0xXX> token. A GGUF holds the pieces and their scores, not
    merges: each piece's ways of being two pieces become its merges, ranked by its score, as llama.cpp's
    tokenizer merges the best-scoring pair first (and as transformers rebuilds the tokenizer from a GGUF).
    Gemma's pieces rank by their place in the vocabulary (`by_position`), as transformers ranks them: its
    scores do not follow its merge order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges") is not None:
        merges = _merges(meta)
    else:
        scores: list[float] = [-float(i) for i in range(len(tokens))] if by_position \
            else meta.need("tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise GGUFError(f"{meta.source}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    # llama.cpp puts a space before the text, then spells every space "▁", as the models' own
    # tokenizer.json files do (a normalizer: "  hi" is "▁▁▁hi", where a Metaspace pre-tokenizer
    # would give "▁▁hi").
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the pieces of higher score first (ties: the longer left
    half, then the longer right; the splits of one piece by their halves' ids)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        splits = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def post_processor(bos: str | None, eos: str | None, backend: BackendTokenizer, byte_level: bool) -> Any:
    """BOS/EOS around every encoded text when the GGUF asks for them (Llama 2 and 3 add BOS), as in the
    original tokenizer.json; otherwise byte-level offsets only (none for SentencePiece)."""
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None

    def template(seq: str, type_id: int) -> str:
        return " ".join(x for x in (bos and f"{bos}:{type_id}", f"${seq}:{type_id}", eos and f"{eos}:{type_id}") if x)

    used = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    return processors.TemplateProcessing(single=template("A", 0), pair=f"{template('A', 0)} {template('B', 1)}",
                                         special_tokens=used)
