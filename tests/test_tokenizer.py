"""Tokenizer and incremental detokenizer, against transformers on the real default model and on tiny
folders written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from pagedrl.model.default import default_gguf_path
from pagedrl.model.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string

TEXTS = [
    "Hello world",
    "The capital of France is",
    "naïve café, résumé, Ærøskøbing, São Paulo",
    "日本語のテキストと中文字符，한국어",
    "emoji 🎉🚀 family 👩‍👩‍👧 flags 🇫🇷",
    "  leading spaces\tand\ttabs\n\n\nnewlines   trailing   ",
    "numbers 12345, 3.14159 and 2025-01-01",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "code:\n    def f(x):\n        return x ** 2  # comment",
    "",
]


def roundtrip_ids(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]


# -- the real default tokenizer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(default_tokenizer, hf_tokenizer, add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert default_tokenizer.encode(text, add_special_tokens) == hf_tokenizer.encode(
            text, add_special_tokens=add_special_tokens), text


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(default_tokenizer, hf_tokenizer, skip_special_tokens: bool) -> None:
    import random

    rng = random.Random(0)
    sequences = roundtrip_ids(default_tokenizer)
    sequences += [[rng.randrange(default_tokenizer.vocab_size) for _ in range(40)] for _ in range(20)]
    for ids in sequences:
        assert default_tokenizer.decode(ids, skip_special_tokens) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens)


def test_transformers_spellings_match_transformers(default_tokenizer, hf_tokenizer) -> None:
    """What scripts written against vLLM's `get_tokenizer()` (a transformers tokenizer) call."""
    texts = TEXTS[:4]
    assert default_tokenizer(texts[0])["input_ids"] == hf_tokenizer(texts[0])["input_ids"]
    assert default_tokenizer(texts)["input_ids"] == hf_tokenizer(texts)["input_ids"]
    ids = [hf_tokenizer.encode(t) for t in texts]
    assert default_tokenizer.batch_decode(ids) == hf_tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert default_tokenizer.convert_ids_to_tokens(ids[0]) == hf_tokenizer.convert_ids_to_tokens(ids[0])
    assert default_tokenizer.convert_ids_to_tokens(ids[0][0]) == hf_tokenizer.convert_ids_to_tokens(ids[0][0])
    tokens = hf_tokenizer.convert_ids_to_tokens(ids[1])
    assert default_tokenizer.convert_tokens_to_ids(tokens) == hf_tokenizer.convert_tokens_to_ids(tokens)
    assert default_tokenizer.get_vocab() == hf_tokenizer.get_vocab()


@pytest.mark.slow
def test_text_roundtrips_through_ids(default_tokenizer) -> None:
    for text in TEXTS:
        assert default_tokenizer.decode(default_tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_matches_the_tokenizer_transformers_builds_from_the_gguf(default_tokenizer) -> None:
    """An independent reading of the same GGUF metadata (vocab, merges, token types) agrees."""
    gguf = default_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in TEXTS:
        assert default_tokenizer.encode(text) == ref.encode(text), text


@pytest.mark.slow
def test_digits_are_split_one_by_one(default_tokenizer) -> None:
    """SmolLM2's pre-tokenizer ('smollm' in llama.cpp) isolates every digit."""
    ids = default_tokenizer.encode("1234567890")
    assert len(ids) == 10
    assert [default_tokenizer.decode([i]) for i in ids] == list("1234567890")


@pytest.mark.slow
def test_special_token_ids(default_tokenizer, hf_tokenizer) -> None:
    assert default_tokenizer.bos_token_id == hf_tokenizer.bos_token_id == default_tokenizer.token_to_id("<|im_start|>")
    assert default_tokenizer.eos_token_id == hf_tokenizer.eos_token_id == default_tokenizer.token_to_id("<|im_end|>")
    assert default_tokenizer.pad_token_id == hf_tokenizer.pad_token_id
    assert default_tokenizer.vocab_size == len(hf_tokenizer) == 49152
    special = default_tokenizer.all_special_ids
    assert set(hf_tokenizer.all_special_ids) <= set(special)
    # every id called special disappears when special tokens are skipped, and no other id does
    for i in range(64):
        assert (default_tokenizer.decode([i], skip_special_tokens=True) == "") == (i in special)


@pytest.mark.slow
def test_save_loads_back_in_transformers_and_here(default_tokenizer, tmp_path: Path) -> None:
    default_tokenizer.save(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    messages = [{"role": "user", "content": "Hi"}]
    for text in TEXTS:
        assert ref.encode(text) == again.encode(text) == default_tokenizer.encode(text)
    assert again.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False)
    assert again.special_tokens == default_tokenizer.special_tokens


# -- tiny folders: the config variants --------------------------------------------------------

SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]


def tiny_backend() -> Backend:
    vocab = {t: i for i, t in enumerate(SPECIALS + ["hello", "world", "!", "the", "cat"])}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return backend


def write_folder(folder: Path, config: dict | None = None, **files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tiny_backend().save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        path = folder / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def test_added_token_dicts_and_pad_fallback_match_transformers(tmp_path: Path) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True},
              "eos_token": "</s>"}
    folder = write_folder(tmp_path, config)
    ours, ref = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (0, 1)
    assert ref.pad_token_id is None and ours.pad_token_id == ours.eos_token_id  # the usual fallback
    assert ours.encode("<s>hello world</s>") == ref.encode("<s>hello world</s>") == [0, 4, 5, 1]
    assert ours.decode([0, 4, 5, 1]) == ref.decode([0, 4, 5, 1], skip_special_tokens=True) == "hello world"


def test_special_tokens_map_overrides_the_config_like_transformers(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"},
                          **{"special_tokens_map.json": json.dumps({"eos_token": "<pad>", "pad_token": "<pad>"})})
    ours, ref = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.eos_token_id == ref.eos_token_id == 2
    assert ours.pad_token_id == ref.pad_token_id == 2


TEMPLATE_A = "{% for m in messages %}A:{{ m['content'] }}{{ eos_token }}{% endfor %}"
TEMPLATE_B = "{% for m in messages %}B:{{ m['content'] }}{% endfor %}{% if tools %}|{{ tools | tojson }}{% endif %}"
TOOLS = [{"type": "function", "function": {"name": "f", "description": "<é>"}}]


@pytest.mark.parametrize("layout", ["config-string", "config-list", "jinja-files"])
def test_chat_template_sources_match_transformers(tmp_path: Path, layout: str) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    files = {}
    if layout == "config-string":
        config["chat_template"] = TEMPLATE_A
    elif layout == "config-list":
        config["chat_template"] = [{"name": "default", "template": TEMPLATE_A},
                                   {"name": "tool_use", "template": TEMPLATE_B}]
    else:  # the file wins over the config entry
        config["chat_template"] = "ignored"
        files = {"chat_template.jinja": TEMPLATE_A, "additional_chat_templates__tool_use.jinja": TEMPLATE_B}
    folder = write_folder(tmp_path, config, **files)
    ours, ref = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False) == "A:hello</s>"
    if layout != "config-string":
        got = ours.apply_chat_template(messages, tools=TOOLS)
        assert got == ref.apply_chat_template(messages, tools=TOOLS, tokenize=False)
        assert got.startswith("B:hello|")
    # saving keeps the templates, in a layout transformers reads back
    out = ours.save(tmp_path / "saved")
    ref2, ours2 = transformers.AutoTokenizer.from_pretrained(out), Tokenizer.from_folder(out)
    assert ours2.chat_template == ours.chat_template
    assert ref2.apply_chat_template(messages, tokenize=False) == ours2.apply_chat_template(messages)


def test_apply_chat_template_tokenize_adds_no_special_tokens(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                     "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"})
    ours, ref = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "the cat"}]
    assert ours.apply_chat_template(messages, tokenize=True) == ref.apply_chat_template(
        messages, tokenize=True, return_dict=False) == [0, 7, 8]


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        Tokenizer.from_folder(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_corrupt_files_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    write_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 3}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"oops": 1}]}))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_folder(tmp_path)


def test_encode_rejects_non_text(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="text must be a str"):
        Tokenizer.from_folder(write_folder(tmp_path)).encode(["hello"])  # type: ignore[arg-type]


# -- incremental detokenization ---------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True, prompt: list[int] | None = None
           ) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [], skip_special_tokens)
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text
    return deltas


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_streamed_deltas_equal_the_full_decode(default_tokenizer, data, skip: bool) -> None:
    # Low ids are the specials and the 256 single bytes, where UTF-8 sequences get split.
    token = st.one_of(st.integers(0, 400), st.integers(0, default_tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=30))
    assert "".join(stream(default_tokenizer, ids, skip)) == default_tokenizer.decode(ids, skip)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_streamed_text_never_shows_a_half_character(default_tokenizer, text: str) -> None:
    ids = default_tokenizer.encode(text)
    full = default_tokenizer.decode(ids)  # == text except for the few bytes the vocabulary lacks
    deltas = stream(default_tokenizer, ids)
    assert "".join(deltas) == full
    assert "\ufffd" in full or all("\ufffd" not in d for d in deltas)


@pytest.mark.slow
def test_multibyte_characters_split_across_tokens(default_tokenizer) -> None:
    text = "🎉🚀 日本語 👩‍👩‍👧 é"
    ids = default_tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the emoji really are split into byte tokens
    naive = [default_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)
    deltas = stream(default_tokenizer, ids)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


@pytest.mark.slow
def test_flush_releases_an_unfinished_character(default_tokenizer) -> None:
    ids = default_tokenizer.encode("ok 🎉")
    cut = next(n for n in range(1, len(ids)) if default_tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(default_tokenizer)
    held = "".join(detok.step(i) for i in ids[:cut])
    assert "\ufffd" not in held
    assert held + detok.flush() == default_tokenizer.decode(ids[:cut])


@pytest.mark.slow
def test_stream_after_a_prompt_continues_its_text(default_tokenizer) -> None:
    prompt = default_tokenizer.encode("The capital of France is")
    completion = default_tokenizer.encode(" Paris, a city of 2 million people 🎉.")
    full = default_tokenizer.decode(prompt + completion)
    deltas = stream(default_tokenizer, completion, prompt=prompt)
    assert "".join(deltas) == full[len(default_tokenizer.decode(prompt)):]


def test_leading_space_decoders_need_the_prefix_window(tmp_path: Path) -> None:
    """A SentencePiece-style decoder strips the first token's space; decoding each token alone would
    strip every space, the prefix window strips only the first."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    ids = [1, 2, 3, 4, 2]
    assert "".join(tok.decode([i]) for i in ids) == "helloworld!againworld"
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "hello world! again world"
    assert "".join(stream(tok, [2, 3], prompt=[1])) == " world!"


def test_find_stop_string_scans_only_what_new_text_can_complete() -> None:
    assert find_stop_string("Hello STOP there", ["STOP"], new_chars=11) == (6, "STOP")
    assert find_stop_string("Hello STOP there", ["STOP"], new_chars=3) is None  # already searched
    assert find_stop_string("abcST", ["STOP"], new_chars=2) is None
    assert find_stop_string("abcSTOP", ["STOP"], new_chars=2) == (3, "STOP")  # completed by the new text
    assert find_stop_string("x\n\ny.", [".", "\n\n"], new_chars=4) == (1, "\n\n")  # earliest wins
    assert find_stop_string("abc", ["", "zz"], new_chars=3) is None
