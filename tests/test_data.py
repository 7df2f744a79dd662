"""Training data: TRL's formats tokenized as TRL tokenizes them, and bad rows named by file, line
and field (or skipped and counted, never dropped quietly)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import EpochStream
from pagedrl.train.data import DataError, load_examples, load_train_and_eval
from pagedrl.train.examples import PreferenceRows, PromptCompletionRows, PromptRows
from pagedrl.train.tokenization import tokenize_preference, tokenize_prompt, tokenize_prompt_completion

CHAT_PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus three"}]
CHAT_COMPLETION = [{"role": "assistant", "content": "five"}]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def convert(tok: Tokenizer, max_length: int | None = 64, truncation: str = "error") -> PromptCompletionRows:
    return PromptCompletionRows(tok, max_length, truncation)


# -- tokenization against TRL ------------------------------------------------------------------


def trl_prompt_completion(hf_tok, prompt, completion):
    """TRL 1.16's SFT tokenize_fn for one prompt-completion row, through TRL's own helpers."""
    from trl.data_utils import _tokenize, common_prefix_length

    if isinstance(prompt, list):
        prompt_ids = _tokenize(hf_tok, prompt, add_generation_prompt=True)["input_ids"]
        full = _tokenize(hf_tok, prompt + completion)["input_ids"]
    else:
        completion = completion if completion.endswith(hf_tok.eos_token) else completion + hf_tok.eos_token
        prompt_ids = _tokenize(hf_tok, prompt)["input_ids"]
        full = _tokenize(hf_tok, prompt + completion)["input_ids"]
    n = common_prefix_length(prompt_ids, full)
    return full[:n], full[n:]


@pytest.mark.parametrize("prompt,completion", [
    ("what is two plus three", " five"),
    ("the cat", "sat on the mat<|im_end|>"),  # already ends with EOS: not doubled
    ("the answer is", "seven"),  # tokens may merge across the boundary
    (CHAT_PROMPT, CHAT_COMPLETION),
])
def test_prompt_completion_ids_match_trl(tok, hf_tok, prompt, completion) -> None:
    ours = tokenize_prompt_completion(tok, prompt, completion)
    assert ours == trl_prompt_completion(hf_tok, prompt, completion)
    assert ours[1], "the completion must keep at least one token"


def test_plain_completion_gets_eos_and_chat_prompt_gets_generation_prompt(tok) -> None:
    _, completion_ids = tokenize_prompt_completion(tok, "hello", " there")
    assert completion_ids[-1] == tok.eos_token_id
    prompt_ids = tokenize_prompt(tok, CHAT_PROMPT)
    assert tok.decode(prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_preference_shares_one_prompt_cut(tok, hf_tok) -> None:
    from trl.data_utils import common_prefix_length

    p, c, r = tokenize_preference(tok, CHAT_PROMPT, CHAT_COMPLETION, [{"role": "assistant", "content": "six"}])
    full_c = hf_tok.apply_chat_template(CHAT_PROMPT + CHAT_COMPLETION, tokenize=True, return_dict=True)["input_ids"]
    prompt = hf_tok.apply_chat_template(CHAT_PROMPT, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    assert p == prompt[:common_prefix_length(prompt, full_c)] and p + c == full_c
    assert c != r and c[-2] == r[-2] == tok.token_to_id("<|im_end|>")
    p2, c2, r2 = tokenize_preference(tok, "2+3=", " five", " six")
    assert c2[-1] == r2[-1] == tok.eos_token_id


# -- bad rows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_line,pattern", [
    ('{"prompt": "a", "completion": ', r"data\.jsonl:3: row: invalid JSON"),
    ('["not", "an", "object"]', r"data\.jsonl:3: row: expected a JSON object, got a list"),
    ('{"prompt": "a"}', r"data\.jsonl:3: completion: missing"),
    ('{"prompt": "a", "completion": 5}', r"data\.jsonl:3: completion: expected a string or a list of chat messages"),
    ('{"prompt": "a", "completion": ""}', r"data\.jsonl:3: completion: empty string"),
    ('{"prompt": "a", "completion": []}', r"data\.jsonl:3: completion: empty list of messages"),
    ('{"prompt": "a", "completion": [{"content": "x"}]}', r"data\.jsonl:3: completion: message 0 is not"),
    ('{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}',
     r"data\.jsonl:3: completion: is a plain string while prompt is a list of chat messages"),
    ('{"question": "a"}', r"data\.jsonl:3: prompt: missing"),
    ('{"prompt": "a", "completion": "' + "the cat sat on the mat " * 20 + '"}',
     r"data\.jsonl:3: completion: prompt \+ completion is \d+ tokens, longer than max_length=64"),
])
def test_bad_row_error_names_file_line_and_field(tok, tmp_path, bad_line, pattern) -> None:
    # line 2 is blank: lines are counted in the file, not in rows
    path = write_jsonl(tmp_path / "data.jsonl", ['{"prompt": "a", "completion": "b"}', "", bad_line,
                                                 '{"prompt": "c", "completion": "d"}'])
    with pytest.raises(DataError, match=pattern):
        load_examples(path, convert(tok))


def test_python_list_rows_are_named_by_index(tok) -> None:
    with pytest.raises(ValueError, match=r"dataset\[1\]: completion: missing"):
        load_examples([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], convert(tok))


def test_skip_policy_counts_every_skipped_row_with_its_reason(tok, tmp_path) -> None:
    long = "the cat sat on the mat " * 20
    path = write_jsonl(tmp_path / "data.jsonl", [
        '{"prompt": "a", "completion": "b", "id": 7}', "{oops", '{"prompt": "a"}', '{"prompt": "c", "completion": 1}',
        json.dumps({"prompt": "x", "completion": long}), '{"prompt": "e", "completion": "f"}',
    ])
    examples, report = load_examples(path, convert(tok, truncation="skip"), on_bad_row="skip")
    assert [e.where for e in examples] == [f"{path}:1", f"{path}:6"]
    assert examples[0].columns == {"id": 7}
    assert report.rows == 6 and report.kept == 2
    assert report.skipped == {"invalid JSON": 1, "missing 'completion'": 1, "wrong type of 'completion'": 1,
                              "longer than max_length=64": 1}
    text = "\n".join(report.lines())
    assert f"first at {path}:2" in text and "skipped 1: invalid JSON" in text


def test_truncation_keeps_the_start_and_is_reported(tok) -> None:
    rows = [{"prompt": "a", "completion": "the cat sat on the mat " * 20}, {"prompt": "b", "completion": "c"}]
    examples, report = load_examples(rows, convert(tok, max_length=16, truncation="truncate"))
    assert len(examples[0].input_ids) == 16 and report.truncated == 1
    full = tokenize_prompt_completion(tok, rows[0]["prompt"], rows[0]["completion"])
    assert examples[0].input_ids == (full[0] + full[1])[:16]
    with pytest.raises(DataError, match=r"dataset\[0\]: prompt: the prompt alone is \d+ tokens"):
        load_examples([{"prompt": "the cat sat on the mat " * 9, "completion": "x"}],
                      convert(tok, max_length=16, truncation="truncate"))


STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                   "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
                   "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_with_template(tiny_train_model: Path, folder: Path, template: str | None) -> Tokenizer:
    """The tiny tokenizer with another chat template (None: without one)."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tiny_train_model / "tokenizer.json").read_bytes())
    config = json.loads((tiny_train_model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # (the folder may carry it in chat_template.jinja instead; not copied)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_folder(folder)


def test_a_row_the_chat_template_refuses_is_named_or_skipped(tiny_train_model, tmp_path) -> None:
    strict = tokenizer_with_template(tiny_train_model, tmp_path / "strict", STRICT_TEMPLATE)
    good = json.dumps({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant",
                                                                                     "content": "b"}]})
    bad = json.dumps({"prompt": [{"role": "usr", "content": "a"}], "completion": [{"role": "assistant",
                                                                                    "content": "b"}]})
    path = write_jsonl(tmp_path / "data.jsonl", [good, bad, good])
    with pytest.raises(DataError, match=r"data\.jsonl:2: row: chat_template: Unknown role: usr"):
        load_examples(path, convert(strict))
    examples, report = load_examples(path, convert(strict), on_bad_row="skip")
    assert len(examples) == 2 and report.skipped == {"refused by the chat template": 1}
    # a tokenizer without a template fails at the first chat row, even when bad rows are skipped
    bare = tokenizer_with_template(tiny_train_model, tmp_path / "bare", None)
    with pytest.raises(DataError, match=r"data\.jsonl:1: chat_template: this tokenizer has no chat template"):
        load_examples(path, convert(bare), on_bad_row="skip")


def test_skipped_evaluation_rows_are_reported_with_the_training_rows(tok, tmp_path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ['{"prompt": "a", "completion": "b"}'])
    held = write_jsonl(tmp_path / "eval.jsonl", ['{"prompt": "a", "completion": "b"}', "{oops"])
    config = SimpleNamespace(dataset=str(train), eval_dataset=str(held), on_bad_row="skip")
    examples, report, eval_examples = load_train_and_eval(config, None, None, convert(tok), "rows")
    assert len(examples) == 1 and len(eval_examples) == 1
    assert report.skipped == {"eval_dataset: invalid JSON": 1}
    assert f"(first at {held}:2)" in "\n".join(report.lines())


def test_an_empty_dataset_is_an_error(tok, tmp_path) -> None:
    with pytest.raises(DataError, match="no usable rows"):
        load_examples(write_jsonl(tmp_path / "e.jsonl", [""]), convert(tok))
    with pytest.raises(DataError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl", convert(tok))


def test_a_utf8_bom_before_the_first_row_is_read_as_utf8(tok, tmp_path) -> None:
    """Notepad and Excel write UTF-8 with a BOM; it is no part of the first row (and only there is it one)."""
    rows = ['{"prompt": "a", "completion": "b"}', '{"prompt": "c", "completion": "d"}']
    plain = tmp_path / "plain.jsonl"
    write_jsonl(plain, rows)
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    ids = [[(e.prompt_ids, e.completion_ids) for e in load_examples(f, convert(tok))[0]] for f in (marked, plain)]
    assert ids[0] == ids[1]
    blank_first = tmp_path / "bom-blank.jsonl"
    blank_first.write_bytes(b"\xef\xbb\xbf\n" + plain.read_bytes())
    assert load_examples(blank_first, convert(tok))[1].rows == 2
    later = tmp_path / "bom-later.jsonl"
    later.write_bytes(plain.read_bytes() + b"\xef\xbb\xbf" + rows[0].encode() + b"\n")
    with pytest.raises(DataError, match=r"bom-later\.jsonl:3: row: invalid JSON"):
        load_examples(later, convert(tok))


def test_language_modeling_rows_train_on_every_token(tok) -> None:
    examples, _ = load_examples([{"text": "hello there"}, {"messages": CHAT_PROMPT + CHAT_COMPLETION}], convert(tok))
    assert examples[0].prompt_ids == [] and examples[0].completion_ids == tok.encode("hello there<|im_end|>")
    assert examples[1].completion_ids == tok.apply_chat_template(CHAT_PROMPT + CHAT_COMPLETION, tokenize=True)


# -- preference and prompt-only rows --------------------------------------------------------------


def test_preference_rows_equal_trl_reward_tokenization(tok, hf_tok) -> None:
    """TRL's RewardTrainer scores tokenize(prompt + answer); our prompt_ids + chosen_ids is exactly that."""
    from trl.data_utils import _tokenize

    rows = [{"prompt": "what is two plus three", "chosen": " five", "rejected": " six", "margin": 2, "src": "a"},
            {"prompt": CHAT_PROMPT, "chosen": CHAT_COMPLETION, "rejected": [{"role": "assistant", "content": "six"}]}]
    pairs, _ = load_examples(rows, PreferenceRows(tok, max_length=64))
    assert pairs[0].margin == 2.0 and pairs[0].columns == {"src": "a"} and pairs[1].margin is None
    eos = hf_tok.eos_token
    assert pairs[0].prompt_ids + pairs[0].chosen_ids == _tokenize(hf_tok, "what is two plus three five" + eos)["input_ids"]
    assert pairs[1].prompt_ids + pairs[1].rejected_ids == _tokenize(hf_tok, CHAT_PROMPT + rows[1]["rejected"])["input_ids"]


@pytest.mark.parametrize("row,pattern", [
    ({"prompt": "a", "chosen": "b"}, r"dataset\[0\]: rejected: missing"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, r"dataset\[0\]: chosen: empty string"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}, r"dataset\[0\]: margin: expected a number"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "margin": float("nan")},
     r"dataset\[0\]: margin: expected a finite number, got nan"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "margin": float("-inf")},
     r"dataset\[0\]: margin: expected a finite number, got -inf"),
    ({"prompt": "a", "chosen": "b", "rejected": "the cat sat on the mat " * 9},
     r"dataset\[0\]: rejected: prompt \+ rejected is \d+ tokens, longer than max_length=16"),
])
def test_bad_preference_rows(tok, row, pattern) -> None:
    with pytest.raises(DataError, match=pattern):
        load_examples([row], PreferenceRows(tok, max_length=16, truncation="error"))


def test_preference_truncation_cuts_each_answer_on_its_own(tok) -> None:
    row = {"prompt": "a", "chosen": "b", "rejected": "the cat sat on the mat " * 9}
    (pair,), report = load_examples([row], PreferenceRows(tok, max_length=16))
    assert len(pair.prompt_ids + pair.rejected_ids) == 16 and pair.chosen_ids[-1] == tok.eos_token_id
    assert report.truncated == 1
    kept, report = load_examples([row, {**row, "rejected": "c"}], PreferenceRows(tok, 16, "skip"))
    assert len(kept) == 1 and report.skipped == {"longer than max_length=16": 1}


def test_prompt_rows_keep_extra_columns_and_refuse_long_prompts(tok, tmp_path) -> None:
    (ex,), _ = load_examples([{"prompt": CHAT_PROMPT, "answer": 5}], PromptRows(tok, max_length=64))
    assert ex.prompt_ids == tokenize_prompt(tok, CHAT_PROMPT) and ex.columns == {"answer": 5} and ex.prompt == CHAT_PROMPT
    path = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "hi"}', '{"question": "hi"}'])
    with pytest.raises(DataError, match=rf"{path}:2: prompt: missing"):
        load_examples(path, PromptRows(tok, max_length=64))
    long = {"prompt": "the cat sat on the mat " * 9}
    with pytest.raises(DataError, match=r"dataset\[0\]: prompt: \d+ tokens, longer than max_length=8"):
        load_examples([long], PromptRows(tok, max_length=8))
    (cut,), _ = load_examples([long], PromptRows(tok, max_length=8, truncation="truncate"))
    assert cut.prompt_ids == tok.encode(long["prompt"])[-8:]


# -- epoch stream ------------------------------------------------------------------------------


def test_epoch_stream_sees_every_row_once_per_epoch_and_resumes() -> None:
    stream = EpochStream(10, seed=3)
    seen = stream.take(7) + stream.take(7) + stream.take(6)
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != list(range(10)) and seen[:10] != seen[10:]
    again = EpochStream(10, seed=3)
    again.take(7)
    state = again.state_dict()
    resumed = EpochStream(10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(13) == seen[7:]
    assert resumed.epoch == 2.0
    with pytest.raises(ValueError, match="the dataset now has 11"):
        EpochStream(11, seed=3).load_state_dict(state)
