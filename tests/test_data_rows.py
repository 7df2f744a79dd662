"""Rows as TRL users write them: preference pairs whose prompt is implicit (split off as TRL's
`extract_prompt` does, and tokenized as TRL's DPOTrainer tokenizes them)."""

from __future__ import annotations

import json
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


# -- tools, chat_template_kwargs and images -------------------------------------------------------

# A ChatML template that writes the tools it is given and a keyword (`think`), as Qwen's and Llama's do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if think and m['role'] == 'assistant' %}think: {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}think: {% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tools_model(tiny_train_model: Path, tmp_path_factory) -> Path:
    """The tiny model with a chat template that renders tools and a keyword."""
    import shutil

    folder = tmp_path_factory.mktemp("tools-model") / "model"
    shutil.copytree(tiny_train_model, folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return folder


def trl_prepared(kind: str, model_dir: Path, rows: list[dict], tmp_path: Path) -> list[dict]:
    """TRL 1.16's own SFTTrainer or DPOTrainer tokenization of `rows`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    config, trainer = (SFTConfig, SFTTrainer) if kind == "sft" else (DPOConfig, DPOTrainer)
    args = config(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to="none", max_length=None)
    made = trainer(model=AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), args=args,
                   train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    return [made.train_dataset[i] for i in range(len(rows))]


def test_sft_rows_give_their_tools_and_template_keywords_to_the_template_as_trl(tools_model, tmp_path) -> None:
    from pagedrl.train.examples import PromptCompletionRows

    tok = Tokenizer.from_folder(tools_model)
    answer = [msg("assistant", "five")]
    rows = [{"prompt": [Q], "completion": answer, "tools": TOOLS, "chat_template_kwargs": {"think": True}},
            {"prompt": [Q], "completion": answer, "tools": TOOLS, "chat_template_kwargs": {"think": False}}]
    examples, _ = load_examples(rows, PromptCompletionRows(tok, None))
    for ex, want in zip(examples, trl_prepared("sft", tools_model, rows, tmp_path), strict=True):
        assert ex.input_ids == want["input_ids"] and len(ex.prompt_ids) == want["labels"].count(-100)
        assert ex.columns == {}
    assert "tools: add" in tok.decode(examples[0].prompt_ids) and "think: " in tok.decode(examples[0].prompt_ids)
    as_string = {"messages": [Q, *answer], "tools": json.dumps(TOOLS)}  # how a column of tools survives Arrow
    lm = [{"messages": [Q, *answer], "tools": TOOLS}, as_string]
    examples, _ = load_examples(lm, PromptCompletionRows(tok, None))
    want = trl_prepared("sft", tools_model, lm[:1], tmp_path)  # a column holds one type: the list one
    assert examples[0].input_ids == examples[1].input_ids == want[0]["input_ids"]
    assert examples[0].input_ids != tok.apply_chat_template([Q, *answer], tokenize=True)


@pytest.mark.parametrize("implicit", [False, True])
def test_preference_rows_give_their_tools_to_the_template_as_trl_dpo(tools_model, tmp_path, implicit) -> None:
    tok = Tokenizer.from_folder(tools_model)
    rows = [{"prompt": [Q], "chosen": [msg("assistant", "five")], "rejected": [msg("assistant", "six")],
             "tools": TOOLS, "chat_template_kwargs": {"think": True}}]
    if implicit:
        rows = [{**r, "chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
        rows = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    pairs, _ = load_examples(rows, PreferenceRows(tok, max_length=None))
    want = trl_prepared("dpo", tools_model, rows, tmp_path)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs] == \
        [(w["prompt_ids"], w["chosen_ids"], w["rejected_ids"]) for w in want]
    assert "tools: add" in tok.decode(pairs[0].prompt_ids)


def test_prompt_rows_render_their_tools_and_keep_them_for_reward_functions(tools_model) -> None:
    from transformers import AutoTokenizer

    from pagedrl.train.examples import PromptRows

    tok, hf_tok = Tokenizer.from_folder(tools_model), AutoTokenizer.from_pretrained(str(tools_model))
    row = {"prompt": [Q], "tools": TOOLS, "chat_template_kwargs": {"think": True}, "answer": 5}
    (ex,), _ = load_examples([row], PromptRows(tok, None))
    assert ex.prompt_ids == hf_tok.apply_chat_template([Q], tools=TOOLS, think=True, add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
    assert ex.template == {"tools": TOOLS, "think": True} and ex.columns["answer"] == 5 and "tools" in ex.columns


@pytest.mark.parametrize("extra,pattern", [
    ({"tools": "{not json"}, r"tools: a string that is not JSON"),
    ({"tools": 3}, r"tools: expected a list of JSON schema objects, got a number"),
    ({"chat_template_kwargs": "x"}, r"chat_template_kwargs: expected an object of template keywords, got a string"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}},
     r"chat_template_kwargs: 'add_generation_prompt' is the trainer's to set, not a row's"),
])
def test_malformed_tools_and_template_keywords_are_named(tok, extra, pattern) -> None:
    with pytest.raises(DataError, match=rf"^dataset\[0\]: {pattern}"):
        load_examples([{**CHAT_PAIRS[0], **extra}], PreferenceRows(tok, max_length=None))


def test_rows_with_images_are_refused_naming_the_line(tok, tmp_path) -> None:
    from pagedrl.train.examples import PromptCompletionRows, PromptRows

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"messages": [Q, msg("assistant", "five")], "images": None},
        {"messages": [Q, msg("assistant", "five")], "images": []},
        {"messages": [Q, msg("assistant", "five")], "images": ["cat.png"]},
    ]))
    with pytest.raises(DataError, match=rf"^{path}:3: images: images and videos are not supported: pagedrl trains "
                                        r"on text only \(a null or empty 'images' is accepted\)$"):
        load_examples(path, PromptCompletionRows(tok, None))
    examples, report = load_examples(path, PromptCompletionRows(tok, None), on_bad_row="skip")
    assert len(examples) == 2 and report.skipped == {"has images or videos": 1}
    with pytest.raises(DataError, match=r"^dataset\[0\]: image: images and videos are not supported"):
        load_examples([{**TEXT_PAIRS[0], "image": {"path": "cat.png"}}], PreferenceRows(tok, None))
    with pytest.raises(DataError, match=r"^dataset\[0\]: videos: images and videos are not supported"):
        load_examples([{"prompt": "hi", "videos": ["clip.mp4"]}], PromptRows(tok, None))
