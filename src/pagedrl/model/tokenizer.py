"""The tokenizer of a Hugging Face folder: `tokenizers` for the text, `tokenizer_config.json` for the rest.

`tokenizer.json` defines the text <-> ids mapping completely (normalizer, pre-tokenizer, model,
post-processor, decoder, added tokens), so it is used verbatim, exactly as transformers 5 uses it when the
file exists. `tokenizer_config.json` adds what the Rust object does not know: which tokens are BOS, EOS
and padding, and the chat template. Streaming output needs one more piece, the incremental
detokenizer at the bottom of this file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pagedrl.model.chat_template import (
    ChatTemplates,
    assistant_token_mask,
    has_generation_block,
    render_chat_template,
    render_chat_template_spans,
    select_chat_template,
)
from pagedrl.model.chat_turns import assistant_spans_from_prefixes
from pagedrl.model.token_bytes import TokenBytes, token_name

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The named special tokens of transformers, in its order; templates see these as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Keys of tokenizer_config.json that `save` rewrites or that only make sense in the original folder.
_REWRITTEN_KEYS = {"chat_template", "added_tokens_decoder", "tokenizer_file", "name_or_path", "tokenizer_class"}


def _token_content(value: Any, source: str, key: str) -> str | None:
    """A special token is written as a string or as a serialized AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{source}: {key!r} must be a string or an AddedToken object, got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> ChatTemplates | None:
    """Template files take precedence over the config entry, as in transformers."""
    found: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        found["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    entry = config.get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(t, Mapping) and {"name", "template"} <= t.keys() for t in entry):
        return {t["name"]: t["template"] for t in entry}
    raise ValueError(f"{folder / CONFIG_FILE}: 'chat_template' must be a string or a list of "
                     "{'name': ..., 'template': ...} objects")


class Tokenizer:
    """Text to ids and back, the special token ids, and the chat template of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str | None] | None = None,
                 chat_template: ChatTemplates | None = None, config: Mapping[str, Any] | None = None) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        unknown = set(self.special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise ValueError(f"special_tokens: unknown names {sorted(unknown)}; expected {SPECIAL_TOKEN_NAMES}")
        self.chat_template = chat_template
        self.config = dict(config or {})
        self._token_bytes: TokenBytes | None = None

    # -- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such folder (expected a model folder with {TOKENIZER_FILE})")
        tok_file = folder / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: file not found; pagedrl needs a fast tokenizer ({TOKENIZER_FILE})")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception for any parse failure
            raise ValueError(f"{tok_file}: not a valid tokenizers file ({e})") from None
        config_file = folder / CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        specials = {name: _token_content(config.get(name), str(config_file), name) for name in SPECIAL_TOKEN_NAMES}
        map_file = folder / SPECIAL_TOKENS_MAP_FILE
        if map_file.is_file() and "added_tokens_decoder" not in config:
            # transformers reads this legacy file only when the config has no added_tokens_decoder, and
            # then lets it override the config's entries.
            for name, value in _read_json(map_file).items():
                if name in SPECIAL_TOKEN_NAMES and value is not None:
                    specials[name] = _token_content(value, str(map_file), name)
        return cls(backend, special_tokens=specials, chat_template=_chat_templates(folder, config), config=config)

    def save(self, folder: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json and the chat template(s) so that transformers'
        AutoTokenizer loads the same tokenizer.

        The class is recorded as PreTrainedTokenizerFast: transformers then uses tokenizer.json as is,
        while a model-specific class would rebuild parts of it (GPT2Tokenizer drops SmolLM2's digit
        splitting, for one), and the two libraries would disagree on the ids.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / TOKENIZER_FILE))
        config = {k: v for k, v in self.config.items() if k not in _REWRITTEN_KEYS and k not in SPECIAL_TOKEN_NAMES}
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.update(self.special_tokens)
        config.setdefault("clean_up_tokenization_spaces", False)
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        templates = self.chat_template
        if isinstance(templates, str):
            templates = {"default": templates}
        stale = folder / CHAT_TEMPLATE_FILE
        if stale.exists() and not (templates and "default" in templates):
            stale.unlink()
        for name, text in (templates or {}).items():
            if name == "default":
                target = folder / CHAT_TEMPLATE_FILE
            else:
                if "/" in name or "\\" in name or name.startswith("."):
                    raise ValueError(f"chat_template: invalid template name {name!r}")
                (folder / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
                target = folder / CHAT_TEMPLATE_DIR / f"{name}.jinja"
            target.write_text(text, encoding="utf-8")
        return folder

    # -- ids ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # transformers' spellings, which scripts written for vLLM's `get_tokenizer()` call

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """`{"input_ids": ...}` for a text (ids) or a list of texts (a list of ids each)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": self.encode_batch(text, add_special_tokens)}

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        return self.token_to_id(tokens) if isinstance(tokens, str) else [self.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, or EOS when the model defines none (the usual choice for decoder-only models)."""
        pad = self._named_id("pad_token")
        return pad if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """Every id `decode(skip_special_tokens=True)` drops: the special added tokens and the named ones.
        (transformers 5 lists only the named and `extra_special_tokens` here, a subset.)"""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in (self._named_id(n) for n in SPECIAL_TOKEN_NAMES) if i is not None)
        return sorted(ids)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The prompt for `messages`, as text or (tokenize=True) as ids; the template writes its own
        special tokens, so none are added when tokenizing, as in transformers."""
        source = select_chat_template(self.chat_template, chat_template, tools)
        text = render_chat_template(source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    special_tokens=self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_assistant_mask(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, prefix_turns: bool = False,
                            **kwargs: Any) -> tuple[list[int], list[int]]:
        """The conversation's ids and which of them the assistant wrote (1) — the tokens overlapping what
        the template's `{% generation %}` blocks rendered — as transformers' `apply_chat_template(...,
        tokenize=True, return_dict=True, return_assistant_tokens_mask=True)` returns them; all 0 when the
        template has no such block, unless `prefix_turns`: then the tokens each assistant message adds to
        the renderings of the conversation's prefixes (`assistant_spans_from_prefixes`, which refuses a
        conversation the template does not render prefix-preserving)."""
        source = select_chat_template(self.chat_template, chat_template, tools)
        if prefix_turns and not has_generation_block(source):
            text, spans = assistant_spans_from_prefixes(source, messages, tools=tools,
                                                        special_tokens=self.special_tokens, **kwargs)
        else:
            text, spans = render_chat_template_spans(source, messages, tools=tools,
                                                     special_tokens=self.special_tokens, **kwargs)
        encoding = self.backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), assistant_token_mask(encoding.offsets, spans)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to the text, even when they are only part of a UTF-8 character."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.backend)
        return self._token_bytes(token_id)

    def token_name(self, token_id: int) -> str:
        """The token's text, or `bytes:\\xNN...` when its bytes are not valid UTF-8 on their own (OpenAI's
        convention for log-probs: distinct tokens never share a name)."""
        return token_name(self.token_bytes(token_id))

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


# How many prompt tokens the first decode window reaches back, so the first output token is decoded
# in context (a leading-space marker, a byte sequence begun in the prompt); vLLM uses the same 5.
INITIAL_PREFIX_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids, whose concatenation equals the full decode.

    Decoding token by token breaks in two ways: a byte-level token can end in the middle of a UTF-8
    character (it decodes to U+FFFD until the rest arrives), and decoders that strip a leading space
    would strip it from every token. So each step decodes a short window that starts a few tokens back
    (`prefix_offset`) and returns what the window gained beyond the already-emitted part
    (`read_offset`), and it holds the text back while it ends in U+FFFD (the vLLM / TGI technique).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.prefix_offset = max(len(self.ids) - INITIAL_PREFIX_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.output_text = ""  # everything emitted so far: the haystack for stop strings

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.output_text += delta
        return delta

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a stream, return any text held back (an unfinished UTF-8 sequence decodes to U+FFFD)."""
        return self._emit(final=True)

    def find_stop(self, stop: Sequence[str], new_chars: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the last `new_chars` characters of `output_text`, and
        where it starts; older text was already searched, so only the tail is scanned."""
        return find_stop_string(self.output_text, stop, new_chars)


def find_stop_string(text: str, stop: Sequence[str], new_chars: int) -> tuple[int, str] | None:
    """Earliest occurrence of any of `stop` that overlaps the last `new_chars` characters of `text`."""
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        start = max(0, len(text) - new_chars - len(s) + 1)
        at = text.find(s, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best
