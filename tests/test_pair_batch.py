"""Packing a preference pair as one row [prompt, chosen, rejected] gives each answer the log-probs
transformers computes for `prompt + answer` on its own: shared prompt, restarted positions,
siblings hidden from each other, padding inert, sliding windows kept."""

from __future__ import annotations

import random

import decoder_bound
import pytest
import torch
from tiny import FAMILIES, freq_error, hf_model

from pagedrl.model.checkpoint import load_causal_lm
from pagedrl.train.algorithms.dpo import answer_logps
from pagedrl.train.algorithms.pair_batch import collate_pairs
from pagedrl.train.examples import Preference


def random_pairs(vocab: int, seed: int) -> list[Preference]:
    rng = random.Random(seed)
    pairs = []
    for i in range(5):
        prompt_len = 0 if i == 3 else rng.randint(1, 7)  # one pair with an empty prompt
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len + 12)]
        pairs.append(Preference(ids[:prompt_len], ids[prompt_len:prompt_len + rng.randint(1, 6)],
                                [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))], f"pair {i}"))
    return pairs


def reference_logps(hf, prompt: list[int], answer: list[int]) -> float:
    """Σ log p(answer token) from transformers on prompt + answer alone; with an empty prompt the
    first answer token has no context and is not scored (as TRL)."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logps = torch.log_softmax(hf(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    token = logps.gather(-1, targets[:, None]).squeeze(-1)
    return float(token[max(len(prompt) - 1, 0):].sum())


@pytest.mark.parametrize("family", ["llama-gqa-untied", "mistral", "qwen3-qknorm", "mixtral", "qwen3-moe",
                                    "phi3-longrope"])
def test_packed_pairs_equal_separate_sequences_in_transformers(family, tmp_path) -> None:
    raw = dict(FAMILIES[family])
    if family == "mistral":
        raw["sliding_window"] = 5  # shorter than the rows, so the window matters
    hf = hf_model(raw)
    hf.save_pretrained(str(tmp_path))
    ours = load_causal_lm(tmp_path, dtype=torch.float32)
    pairs = random_pairs(raw["vocab_size"], seed=len(family))
    batch = collate_pairs(pairs, pad_id=0, device=torch.device("cpu"), answer_tokens=True,
                          sliding_window=ours.config.sliding_window)
    with torch.no_grad():
        got = answer_logps(ours, batch, with_logits=True)
    expected = [reference_logps(hf, p.prompt_ids, p.chosen_ids) for p in pairs]
    expected += [reference_logps(hf, p.prompt_ids, p.rejected_ids) for p in pairs]
    # both within float32's bound of the exact sums (`decoder_bound`, ~1e-3 on sums of ~50 over ~10
    # tokens; a key outside the window or another answer's token moves them by 1e-2 or more)
    exact, bound = decoder_bound.answer_logprob_sums(ours, batch, freq_error(hf, ours))
    for logps in (got.logps, torch.tensor(expected)):
        assert ((logps.double() - exact).abs() <= bound).all()
    assert got.mean_logits.shape == batch.targets.shape
    assert batch.answer_lengths.tolist() == [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]


def test_scores_are_read_at_the_last_non_pad_token() -> None:
    pairs = [Preference([5, 6], [7, 0], [8, 9, 10], "a"), Preference([], [11], [12, 13], "b")]
    batch = collate_pairs(pairs, pad_id=0, device=torch.device("cpu"), scores=True, score_pad_id=0)
    width = batch.input_ids.shape[1]
    # pair a: chosen "5 6 7 0" → token 7 (row 2); rejected at row 2 + 2 + 2 = 6; pair b: rows 0 and 2
    assert batch.score_at.tolist() == [2, width + 0, 6, width + 2]
    flat = batch.input_ids.reshape(-1)
    assert flat[batch.score_at].tolist() == [7, 11, 10, 13]
    assert batch.margins is None and batch.num_tokens == (4 + 5) + (1 + 2)
