"""`truncation_mode: keep_end` against TRL 1.16's SFTTrainer and DPOTrainer, the two that read it: SFT's
rows as TRL prepares them (tokens and labels) and its first batch's loss and gradients; DPO's two
sequences of each pair as TRL's collator cuts them (each answer its own end of the prompt), the tokens
our pair row scores, and the first batch's per-answer log-probs and loss."""

from __future__ import annotations

import pytest
import torch
from first_batches import TOLERANCE, ours_first_batch, trl_first_batch
from preference_data import dpo_trainer, preference_rows
from test_dpo_trl import other_model  # noqa: F401 (a fixture)
from test_dpo_trl import trl_first_batch as trl_dpo_first_batch
from test_sft_assistant_only import template_file  # noqa: F401 (a fixture)
from test_sft_packing_trl import _labels
from test_sft_trl import trl_prepared_rows
from tiny_train import arithmetic_rows, chat_rows, sft_trainer

from pagedrl.train.algorithms.dpo import answer_logps
from pagedrl.train.algorithms.pair_batch import collate_pairs
from pagedrl.train.examples import Preference


def _sft_rows(kind: str) -> list[dict]:
    if kind == "messages":
        return chat_rows(12)
    return [r for r in arithmetic_rows(24) if isinstance(r["prompt"], str) == (kind == "plain")]


@pytest.mark.parametrize(("kind", "max_length"), [("plain", 15), ("plain", 8), ("chat", 30), ("messages", 40)])
def test_sft_keep_end_rows_equal_trl(tiny_train_model, tmp_path, kind, max_length) -> None:
    """TRL's prepared rows under keep_end: each row's last `max_length` tokens and their labels (a prompt
    cut from its start; at 8 the completion's start too, the prompt being 10 tokens), none dropped."""
    rows = _sft_rows(kind)
    theirs = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", max_length=max_length,
                               truncation_mode="keep_end")
    ours = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, max_length=max_length,
                       truncation_mode="keep_end").algorithm.examples
    assert [(e.input_ids, _labels(e)) for e in ours] == [(r["input_ids"], r["labels"]) for r in theirs]
    whole = sft_trainer(tiny_train_model, tmp_path / "whole", rows=rows, max_length=None).algorithm.examples
    assert sum(len(e.input_ids) > max_length for e in whole) >= len(rows) // 2


def test_sft_keep_end_first_batch_equals_trl(tiny_train_model, tmp_path) -> None:
    rows = _sft_rows("plain")
    settings = dict(max_length=8, truncation_mode="keep_end")
    features, trl_loss, trl_grads, _ = trl_first_batch("sft", tiny_train_model, rows, tmp_path / "trl", **settings)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **settings).algorithm
    examples, loss, grads, _ = ours_first_batch(algorithm)
    assert [e.input_ids for e in examples] == [f["input_ids"] for f in features]
    assert abs(loss - trl_loss) < TOLERANCE
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name


def test_sft_keep_end_leaves_packed_rows_to_their_strategy(tiny_train_model, tmp_path) -> None:
    """TRL's packer ignores truncation_mode (bfd keeps each example's start): so do packed rows here."""
    rows = _sft_rows("plain")
    settings = dict(max_length=15, packing=True, truncation_mode="keep_end")
    theirs = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", **settings)
    ours = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **settings).algorithm.examples
    assert [[t for e in row.examples for t in e.input_ids] for row in ours] == [r["input_ids"] for r in theirs]


def _long_pairs(n: int = 8) -> list[dict]:
    """Preference rows whose answers differ in length, so keep_end leaves them different ends of the prompt."""
    return [dict(r, prompt=r["prompt"] + " red green blue" * (i % 3), rejected=r["rejected"] + " the cat" * (i % 4))
            for i, r in enumerate(preference_rows(n, seed=3))]


def test_dpo_keep_end_pairs_equal_trl_collator(tiny_train_model, tmp_path) -> None:
    """Each pair's prompt + chosen and prompt + rejected as TRL's DataCollatorForPreference cuts them
    (its last `max_length` tokens each, the answer's tokens where its completion mask says), and our pair
    row scoring exactly those answer tokens."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rows = _long_pairs()
    algorithm = dpo_trainer(tiny_train_model, tmp_path, rows, max_length=10, truncation_mode="keep_end").algorithm
    plain = dpo_trainer(tiny_train_model, tmp_path / "p", rows, max_length=None).algorithm
    collator = DataCollatorForPreference(pad_token_id=0, max_length=10, truncation_mode="keep_end")
    pairs: list[Preference] = algorithm.examples
    assert any(p.rejected_prompt_ids is not None for p in pairs) and any(p.rejected_prompt_ids is None for p in pairs)
    for pair, whole in zip(pairs, plain.examples, strict=True):
        batch = collator([{"prompt_ids": whole.prompt_ids, "chosen_ids": whole.chosen_ids,
                           "rejected_ids": whole.rejected_ids}])
        own = pair.prompt_ids if pair.rejected_prompt_ids is None else pair.rejected_prompt_ids
        for k, (prompt, answer) in enumerate(((pair.prompt_ids, pair.chosen_ids), (own, pair.rejected_ids))):
            real = batch["attention_mask"][k].bool()
            assert batch["input_ids"][k][real].tolist() == prompt + answer
            assert batch["completion_mask"][k][real].tolist() == [0] * len(prompt) + [1] * len(answer)
        scored = collate_pairs([pair], 0, torch.device("cpu"), answer_tokens=True)
        want = pair.chosen_ids[0 if pair.prompt_ids else 1:] + pair.rejected_ids[0 if own else 1:]
        assert scored.targets.tolist() == want
        # a mixture of experts' router loss weighs each token by the TRL rows holding it: a prompt of the
        # chosen answer's alone is in one
        assert scored.token_weights is not None
        assert float(scored.token_weights.sum()) == scored.num_tokens == int(batch["attention_mask"].sum())


def test_dpo_keep_end_first_batch_equals_trl(tiny_train_model, other_model, tmp_path) -> None:  # noqa: F811
    """TRL's DPOTrainer with keep_end against another reference: the policy's per-answer log-probs and the
    loss of the first four pairs, some of whose answers keep different ends of their prompt."""
    from pagedrl.model.loader import load_model

    rows = _long_pairs()
    settings = dict(beta=0.3, max_length=10, truncation_mode="keep_end")
    _, trl_loss, trl_logps, _, _ = trl_dpo_first_batch(tiny_train_model, other_model, rows, tmp_path, **settings)
    trainer = dpo_trainer(tiny_train_model, tmp_path / "ours", rows, reference=load_model(other_model).model,
                          per_device_train_batch_size=4, **settings)
    algorithm = trainer.algorithm
    assert any(p.rejected_prompt_ids is not None for p in algorithm.examples[:4])
    batch = algorithm.collate(algorithm.examples[:4])
    with torch.no_grad():
        logps = answer_logps(algorithm.model, batch).logps
    torch.testing.assert_close(logps, trl_logps, rtol=0, atol=1e-4)
    loss, _ = algorithm.loss(trainer.handle, batch, torch.tensor(4.0))
    assert abs(float(loss.detach()) - trl_loss) < TOLERANCE


def test_truncation_mode_values_are_trl_s() -> None:
    """SFT and DPO take TRL's two values; the reward model, whose TRL config has no truncation_mode, its
    default alone."""
    from pagedrl.train.config import load_config
    from pagedrl.train.offline_config import DPOConfig, RewardConfig, SFTConfig

    for cls in (SFTConfig, DPOConfig):
        assert load_config(cls, None, ["truncation_mode=keep_end"]).truncation_mode == "keep_end"
        with pytest.raises(ValueError, match=r"^command line: truncation_mode: expected one of 'keep_start', "
                                             r"'keep_end', got 'left'"):
            load_config(cls, None, ["truncation_mode=left"])
    with pytest.raises(ValueError, match=r"^command line: truncation_mode: only keep_start"):
        load_config(RewardConfig, None, ["truncation_mode=keep_end"])


def test_sft_keep_end_with_assistant_only_loss_equals_trl(tiny_train_model, template_file,  # noqa: F811
                                                          tmp_path) -> None:
    """The assistant's tokens of the rows' last `max_length` tokens labelled, as TRL slices its labels."""
    keys = dict(assistant_only_loss=True, chat_template_path=str(template_file), max_length=30,
                truncation_mode="keep_end")
    rows = chat_rows(12)
    theirs = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", **keys)
    ours = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **keys).algorithm.examples
    assert [(e.input_ids, _labels(e)) for e in ours] == [(r["input_ids"], r["labels"]) for r in theirs]
    assert all(-100 in r["labels"] for r in theirs)
