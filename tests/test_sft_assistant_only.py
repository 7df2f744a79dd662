"""SFT's `assistant_only_loss` and `chat_template_path` against TRL 1.16's SFTTrainer: the labels (the
assistant's tokens of chat rows, marked by the template's `{% generation %}` blocks), a first batch's loss
and every gradient padded, packed and padding-free, the template saved with the model, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from first_batches import TOLERANCE, ours_first_batch, trl_first_batch
from test_sft_trl import trl_prepared_rows
from tiny_train import CHAT_TEMPLATE_GENERATION, arithmetic_rows, chat_rows, sft_trainer

from pagedrl.train.algorithms.sft import label_mask
from pagedrl.train.data import DataError


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chatml_training.jinja"
    path.write_text(CHAT_TEMPLATE_GENERATION, encoding="utf-8")
    return path


def _labels(example, completion_only: bool = True) -> list[int]:
    """An example's labels as TRL writes them: the token, or -100 where it carries none."""
    keep = label_mask(example, completion_only)
    return [t if k else -100 for t, k in zip(example.input_ids, keep, strict=True)]


@pytest.mark.parametrize("settings", [{}, {"padding_free": True}], ids=["padded", "padding_free"])
def test_first_batch_equals_trl_sft_trainer(tiny_train_model, template_file, tmp_path, settings) -> None:
    """Multi-turn `messages` rows (some with a system message): the same ids and labels, and the first batch's
    loss and every gradient as TRL's SFTTrainer's with assistant_only_loss=True and the same chat_template_path."""
    rows = chat_rows(8)
    keys = dict(assistant_only_loss=True, chat_template_path=str(template_file), **settings)
    features, trl_loss, trl_grads, _ = trl_first_batch("sft", tiny_train_model, rows, tmp_path / "trl", **keys)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **keys).algorithm
    examples, loss, grads, _ = ours_first_batch(algorithm)
    assert [e.input_ids for e in examples] == [f["input_ids"] for f in features]
    assert [_labels(e) for e in examples] == [f["labels"] for f in features]
    labelled = sum(label_mask(e, True).count(True) for e in examples)
    assert 0 < labelled < sum(len(e.input_ids) // 2 for e in examples)  # the prompts' tokens carry none
    assert abs(loss - trl_loss) < TOLERANCE
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name
    whole = sft_trainer(tiny_train_model, tmp_path / "whole", rows=rows, chat_template_path=str(template_file))
    assert abs(ours_first_batch(whole.algorithm)[1] - loss) > 1e-3  # every token's loss is another number


def test_packing_equals_trl_sft_trainer(tiny_train_model, template_file, tmp_path) -> None:
    """`packing: true` (bfd): TRL's packed rows with its labels, and the first batch of two packed rows."""
    rows = chat_rows(24)
    keys = dict(assistant_only_loss=True, chat_template_path=str(template_file), packing=True, max_length=128)
    trl_rows = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl-rows", **keys)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, per_device_train_batch_size=2,
                            **keys).algorithm
    assert len(algorithm.examples) == len(trl_rows) < len(rows)
    for row, want in zip(algorithm.examples, trl_rows, strict=True):
        assert [t for e in row.examples for t in e.input_ids] == want["input_ids"]
        assert [t for e in row.examples for t in _labels(e)] == want["labels"]
    _, trl_loss, trl_grads, _ = trl_first_batch("sft", tiny_train_model, rows, tmp_path / "trl", size=2, **keys)
    _, loss, grads, _ = ours_first_batch(algorithm, size=2)
    assert abs(loss - trl_loss) < TOLERANCE
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name


@pytest.mark.parametrize("completion_only", [True, False])
def test_chat_prompt_completion_rows_label_the_assistants_completion_as_trl(tiny_train_model, template_file,
                                                                            tmp_path, completion_only) -> None:
    """Chat prompt/completion rows: labels where the completion and the assistant's tokens meet, as TRL's;
    with completion_only_loss: false, the prompt's assistant turns too."""
    rows = [r for r in arithmetic_rows(12) if isinstance(r["prompt"], list)]
    rows[0]["prompt"] = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "red green"},
                         *rows[0]["prompt"]]  # an assistant turn in the prompt
    keys = dict(assistant_only_loss=True, chat_template_path=str(template_file), completion_only_loss=completion_only)
    trl_rows = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", **keys)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **keys).algorithm
    assert [e.input_ids for e in algorithm.examples] == [r["input_ids"] for r in trl_rows]
    assert [_labels(e, completion_only) for e in algorithm.examples] == [r["labels"] for r in trl_rows]
    first = algorithm.examples[0]
    assert (sum(first.assistant_mask) > sum(label_mask(first, completion_only))) is completion_only


def test_max_length_cuts_the_mask_and_drops_rows_left_without_a_label(tiny_train_model, template_file,
                                                                       tmp_path) -> None:
    rows = chat_rows(12)
    keys = dict(assistant_only_loss=True, chat_template_path=str(template_file), max_length=30)
    trl_rows = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", **keys)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **keys).algorithm
    assert algorithm.report.skipped  # the system message and question fill 30 tokens in some rows
    assert [_labels(e) for e in algorithm.examples] == [r["labels"] for r in trl_rows]


def _trl_saved(folder: Path, out: Path, **keys) -> Path:
    """TRL's SFTTrainer built with `keys` and its model saved to `out`, as its run ends."""
    from datasets import Dataset
    from first_batches import theirs
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(out / "run"), bf16=False, use_cpu=True, report_to="none", **keys)
    trainer = SFTTrainer(model=theirs(folder), args=args, train_dataset=Dataset.from_list(chat_rows(4)),
                         processing_class=AutoTokenizer.from_pretrained(str(folder)))
    trainer.save_model(str(out))
    return out


def test_chat_template_path_file_is_used_and_saved_as_trl_saves_it(tiny_train_model, template_file,
                                                                   tmp_path) -> None:
    trainer = sft_trainer(tiny_train_model, tmp_path / "ours", rows=chat_rows(8), max_steps=1,
                          chat_template_path=str(template_file))
    assert trainer.algorithm.tokenizer.chat_template == CHAT_TEMPLATE_GENERATION
    final = trainer.train()
    theirs = _trl_saved(tiny_train_model, tmp_path / "trl", chat_template_path=str(template_file))
    assert (final / "chat_template.jinja").read_text() == (theirs / "chat_template.jinja").read_text()
    assert (final / "chat_template.jinja").read_text() == CHAT_TEMPLATE_GENERATION


def test_chat_template_path_folder_brings_its_template_and_eos_as_trl(tiny_train_model, tmp_path) -> None:
    """A tokenizer folder: its chat template and its end-of-sequence token, in the saved tokenizer, config
    and generation config (TRL also resizes the embeddings to a multiple of 64, which pagedrl does not)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_train_model / name, source / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "chat_template.jinja").write_text(CHAT_TEMPLATE_GENERATION)
    final = sft_trainer(tiny_train_model, tmp_path / "ours", rows=chat_rows(8), max_steps=1,
                        chat_template_path=str(source)).train()
    theirs = _trl_saved(tiny_train_model, tmp_path / "trl", chat_template_path=str(source))
    assert (final / "chat_template.jinja").read_text() == (theirs / "chat_template.jinja").read_text()
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id"),
                      ("generation_config.json", "eos_token_id")):
        ours, want = (json.loads((f / name).read_text())[key] for f in (final, theirs))
        assert ours == want != json.loads((tiny_train_model / name).read_text())[key], name


# SmolLM2's assistant turn, as TRL's training templates mark a ChatML one: content, <|im_end|> and newline.
SMOLLM2_TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
SMOLLM2_MARKED_TURN = ("{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
                       "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
                       "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}")


def test_the_default_models_own_template_trains_on_the_assistants_tokens_as_trl(default_model_dir,
                                                                                   tmp_path) -> None:
    """SmolLM2's ChatML has no generation block: the assistant's tokens are found from it, the rows' ids and
    labels equal to TRL's SFTTrainer's given that template with the assistant's turns marked (as its training
    templates mark them), the end-of-turn token trained by TRL's probe, and the start-up says how."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_stop_token_trained

    original = json.loads((default_model_dir / "tokenizer_config.json").read_text()).get("chat_template") or (
        default_model_dir / "chat_template.jinja").read_text()
    assert SMOLLM2_TURN in original
    marked = tmp_path / "marked.jinja"
    marked.write_text(original.replace(SMOLLM2_TURN, SMOLLM2_MARKED_TURN))
    rows = chat_rows(4)
    trl_rows = trl_prepared_rows(default_model_dir, rows, tmp_path / "trl", assistant_only_loss=True,
                                 chat_template_path=str(marked))
    algorithm = sft_trainer(default_model_dir, tmp_path / "ours", rows=rows, assistant_only_loss=True).algorithm
    assert [e.input_ids for e in algorithm.examples] == [r["input_ids"] for r in trl_rows]
    assert [_labels(e) for e in algorithm.examples] == [r["labels"] for r in trl_rows]
    labelled = sum(label_mask(e, True).count(True) for e in algorithm.examples)
    assert 0 < labelled < sum(len(e.input_ids) for e in algorithm.examples) // 2  # the default system message's none
    batch = algorithm.collate(algorithm.examples)  # the loss's targets: those labels, nothing else
    assert batch.targets.tolist() == [t for e in algorithm.examples for t in _labels(e)[1:] if t != -100]
    assert algorithm.stops_trained is is_chat_template_stop_token_trained(
        AutoTokenizer.from_pretrained(str(default_model_dir)), marked.read_text()) is True
    assert any("renderings of the conversation's prefixes" in line for line in algorithm.summary_lines())


# -- refusals ------------------------------------------------------------------------------------


# A template closing the conversation with EOS (as Phi-3's): no turn followed by another is found from it.
CLOSED_WITH_EOS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}")


def test_a_template_not_prefix_preserving_refuses_the_rows_it_cannot_read(tiny_train_model, tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(CLOSED_WITH_EOS)
    with pytest.raises(DataError, match=r"^dataset\[1\]: row: chat_template_path: .*messages\[1\] cannot be found.*"
                                        r"not prefix-preserving"):
        sft_trainer(tiny_train_model, tmp_path / "a", rows=chat_rows(4), assistant_only_loss=True,
                    chat_template_path=str(path))
    single = [r for r in chat_rows(8) if len(r["messages"]) <= 3]  # one exchange: the turn ends the rendering
    algorithm = sft_trainer(tiny_train_model, tmp_path / "b", rows=single, assistant_only_loss=True,
                            chat_template_path=str(path)).algorithm
    assert algorithm.probe_refused and any("not prefix-preserving" in line for line in algorithm.summary_lines())


def test_a_row_with_no_assistant_tokens_is_refused_in_trls_words(tiny_train_model, template_file, tmp_path) -> None:
    rows = chat_rows(4) + [{"messages": [{"role": "user", "content": "hello there"}]}]
    with pytest.raises(DataError, match=r"^dataset\[4\]: messages: has no assistant tokens .*may be missing the "
                                        r"`\{% generation %\}` keyword"):
        sft_trainer(tiny_train_model, tmp_path, rows=rows, assistant_only_loss=True,
                    chat_template_path=str(template_file))


@pytest.mark.parametrize("row", [{"text": "the cat sat"}, {"prompt": "what is", "completion": " five"}])
def test_plain_text_rows_are_refused(tiny_train_model, template_file, tmp_path, row) -> None:
    with pytest.raises(DataError, match=r"is plain text, and assistant_only_loss: true needs conversational rows"):
        sft_trainer(tiny_train_model, tmp_path, rows=[*chat_rows(2), row], assistant_only_loss=True,
                    chat_template_path=str(template_file))


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: p / "missing.jinja", r"expected a \.jinja or \.j2 template file or a tokenizer folder"),
    (lambda p: (p / "t.txt").write_text("x") and p / "t.txt", r"expected a \.jinja or \.j2 template file"),
    (lambda p: (p / "bad.jinja").write_text("{% for m in messages %}") and p / "bad.jinja", r"syntax error at line 1"),
    (lambda p: p, r"tokenizer\.json: file not found"),
])
def test_bad_chat_template_paths_are_refused_by_name(tiny_train_model, tmp_path, make, words) -> None:
    folder = tmp_path / "given"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"^chat_template_path: .*{words}"):
        sft_trainer(tiny_train_model, tmp_path / "out", rows=chat_rows(2), chat_template_path=str(make(folder)))


def test_a_folder_with_tokens_the_model_lacks_is_refused(tiny_train_model, tmp_path) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    source = tmp_path / "source"
    source.mkdir()
    backend = Backend.from_file(str(tiny_train_model / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|eot|>", special=True)])
    backend.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE_GENERATION}))
    with pytest.raises(ValueError, match=r"lacks \('<\|eot\|>'\); TRL adds them and resizes the embeddings"):
        sft_trainer(tiny_train_model, tmp_path / "out", rows=chat_rows(2), chat_template_path=str(source))


def test_chat_template_path_is_no_longer_refused_but_other_configs_keep_refusing_it() -> None:
    from pagedrl.train.config import load_config
    from pagedrl.train.offline_config import RewardConfig, SFTConfig

    assert load_config(SFTConfig, None, ["chat_template_path=t.jinja"]).chat_template_path == "t.jinja"
    with pytest.raises(ValueError, match=r"chat_template_path: only None .*put the template there"):
        load_config(RewardConfig, None, ["chat_template_path=t.jinja"])


@pytest.mark.parametrize("inside", [True, False])
def test_an_end_of_turn_token_outside_the_block_is_said_at_start_as_trl_warns(tiny_train_model, tmp_path,
                                                                             inside: bool) -> None:
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_stop_token_trained

    template = CHAT_TEMPLATE_GENERATION if inside else CHAT_TEMPLATE_GENERATION.replace(
        "<|im_end|>{% endgeneration %}", "{% endgeneration %}<|im_end|>")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "out", rows=chat_rows(4), assistant_only_loss=True,
                            chat_template_path=str(path)).algorithm
    trl_says = is_chat_template_stop_token_trained(AutoTokenizer.from_pretrained(str(tiny_train_model)), template)
    assert algorithm.stops_trained is trl_says is inside
    assert any("may not learn to stop" in line for line in algorithm.summary_lines()) is not inside
