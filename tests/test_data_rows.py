"""Rows as TRL users write them: preference pairs whose prompt is implicit (split off as TRL's
`extract_prompt` does, and tokenized as TRL's DPOTrainer tokenizes them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.data import DataError, load_examples
from pagedrl.train.examples import PreferenceRows
from pagedrl.train.tokenization import extract_prompt


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


Q, Q2 = msg("user", "what is two plus three"), msg("user", "and two plus four")
TEXT_PAIRS = [
    {"chosen": "what is two plus three five", "rejected": "what is two plus three six"},
    {"chosen": "the cat sat on the mat", "rejected": "the cat ran in the park"},
    {"chosen": "the answer is", "rejected": "the answer is seven"},  # one starts with all of the other
    {"chosen": "hello there", "rejected": "hello there"},
    {"chosen": "yes", "rejected": "no"},  # nothing shared: an empty prompt
]
CHAT_PAIRS = [
    {"chosen": [Q, msg("assistant", "five")], "rejected": [Q, msg("assistant", "six")]},
    {"chosen": [msg("system", "be brief"), Q, msg("assistant", "five")],
     "rejected": [msg("system", "be brief"), Q, msg("assistant", "it is six")]},
    {"chosen": [Q, msg("assistant", "five")], "rejected": [Q, msg("assistant", "five"), Q2, msg("assistant", "six")]},
]


@pytest.fixture(scope="module")
def tok(tiny_train_model: Path) -> Tokenizer:
    return Tokenizer.from_folder(tiny_train_model)


@pytest.fixture(scope="module")
def hf_tok(tiny_train_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_train_model))


@pytest.mark.parametrize("row", TEXT_PAIRS + CHAT_PAIRS)
def test_implicit_prompt_is_split_as_trl_extract_prompt_splits_it(row) -> None:
    from trl.data_utils import extract_prompt as trl_extract_prompt

    want = trl_extract_prompt(row)
    assert extract_prompt(row["chosen"], row["rejected"]) == (want["prompt"], want["chosen"], want["rejected"])


def test_a_pair_sharing_nothing_has_an_empty_prompt() -> None:
    """TRL reads the character before a first-character difference as the answer's last (index -1):
    with chosen ending in a space, all but one character of it would become the prompt."""
    from trl.data_utils import extract_prompt as trl_extract_prompt

    assert trl_extract_prompt({"chosen": "yes ", "rejected": "no"}) == {"prompt": "yes", "chosen": " ",
                                                                          "rejected": "o"}
    assert extract_prompt("yes ", "no") == ("", "yes ", "no")


def trl_dpo_dataset(model_dir: Path, rows: list[dict], tmp_path: Path) -> list[dict]:
    """TRL 1.16's DPOTrainer's own tokenized rows for `rows`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to="none", max_length=None)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    return [trainer.train_dataset[i] for i in range(len(rows))]


@pytest.mark.parametrize("rows", [TEXT_PAIRS, CHAT_PAIRS], ids=["text", "chat"])
def test_implicit_prompt_pairs_tokenize_as_trl_dpo_trainer_tokenizes_them(tok, tiny_train_model, tmp_path,
                                                                          rows) -> None:
    pairs, _ = load_examples(rows, PreferenceRows(tok, max_length=None))
    want = trl_dpo_dataset(tiny_train_model, rows, tmp_path)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs] == \
        [(w["prompt_ids"], w["chosen_ids"], w["rejected_ids"]) for w in want]


def test_implicit_prompt_pairs_score_the_whole_answer_as_trl_reward_trainer(tok, hf_tok) -> None:
    """TRL's RewardTrainer tokenizes an implicit-prompt row's `chosen` and `rejected` whole."""
    from trl.data_utils import _tokenize

    pairs, _ = load_examples(TEXT_PAIRS + CHAT_PAIRS, PreferenceRows(tok, max_length=None))
    for pair, row in zip(pairs, TEXT_PAIRS + CHAT_PAIRS, strict=True):
        for ids, key in ((pair.chosen_ids, "chosen"), (pair.rejected_ids, "rejected")):
            text = row[key] if isinstance(row[key], list) else row[key] + hf_tok.eos_token
            assert pair.prompt_ids + ids == _tokenize(hf_tok, text)["input_ids"]


def test_explicit_prompt_rows_are_read_as_before_and_bad_implicit_rows_are_named(tok) -> None:
    explicit = {"prompt": "what is two plus three", "chosen": " five", "rejected": " six"}
    (a, b), _ = load_examples([explicit, TEXT_PAIRS[0]], PreferenceRows(tok, max_length=None))
    assert (a.prompt_ids, a.chosen_ids, a.rejected_ids) == (b.prompt_ids, b.chosen_ids, b.rejected_ids)
    with pytest.raises(DataError, match=r"^dataset\[1\]: chosen: shares no first message with 'rejected', so there "
                                        r"is no prompt to take from their start \(give the row a 'prompt'\)$"):
        load_examples([CHAT_PAIRS[0], {"chosen": [Q, msg("assistant", "five")], "rejected": [Q2]}],
                      PreferenceRows(tok, max_length=None))
    with pytest.raises(DataError, match=r"^dataset\[0\]: rejected: missing"):
        load_examples([{"chosen": "a"}], PreferenceRows(tok, max_length=None))
    with pytest.raises(DataError, match=r"^dataset\[0\]: chosen: is a plain string while rejected is a list"):
        load_examples([{"chosen": "a", "rejected": [Q]}], PreferenceRows(tok, max_length=None))
