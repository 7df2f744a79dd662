"""`pagedrl rlhf`: verifier-labelled pairs, a reward model, PPO against it; a second call finds every
stage complete and skips it."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from pagedrl.cli import main
from pagedrl.train.logging import read_metrics


def parity(prompts, completions, completion_ids, **kwargs):
    """A stand-in verifier the tiny random model can satisfy: a completion starting with an even id is 'correct'."""
    return [float(ids[0] % 2 == 0) for ids in completion_ids]


def test_the_recipe_runs_every_stage_then_skips_them(tiny_train_model, tmp_path, monkeypatch, capsys) -> None:
    import pagedrl.train.rl.rewards as rewards

    monkeypatch.setattr(rewards, "last_integer_match", parity)
    recipe = {
        "output_dir": str(tmp_path / "out"), "model": str(tiny_train_model), "seed": 1,
        "task_low": 1, "task_high": 9, "task_num_eval": 4,
        "pairs": {"num_prompts": 8, "num_generations": 4, "max_tokens": 6},
        "rm": {"per_device_train_batch_size": 4, "max_steps": 2, "report_to": ["jsonl"], "learning_rate": 1e-3},
        "ppo": {"num_generations": 2, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                "num_ppo_epochs": 1, "max_completion_length": 6, "max_steps": 2, "eval_steps": 2,
                "report_to": ["jsonl"], "learning_rate": 1e-3, "logging_steps": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["rlhf", str(path), "ppo.kl_coef=0.2"]) == 0
    out = tmp_path / "out"
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert {"prompt", "chosen", "rejected", "answer"} <= set(pairs[0])
    assert pairs[0]["prompt"].endswith("assistant\n") and isinstance(pairs[0]["chosen"], str)  # rendered text
    stats = json.loads((out / "pairs.json").read_text())
    assert stats["pairs"] == len(pairs)
    assert (out / "rm" / "final" / "config.json").is_file()
    rows = [r for r in read_metrics(out / "ppo" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and "objective/scores" in rows[1]
    assert rows[1]["objective/kl_coef"] == pytest.approx(0.2)  # the dotted override reached PPO
    capsys.readouterr()
    assert main(["rlhf", str(path)]) == 0
    said = capsys.readouterr().out
    assert said.count("skipped") == 3, said


def test_a_bad_recipe_is_refused_with_its_key(tmp_path, capsys) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("output_dir: x\npairs: {num_prompt: 3}\n")
    assert main(["rlhf", str(path)]) == 2
    assert "pairs: unknown keys ['num_prompt']" in capsys.readouterr().err


def test_pairs_use_every_completion_before_reusing_one() -> None:
    from pagedrl.train.rl.pairs import pair_order

    assert pair_order([10, 11], [20, 21, 22])[:4] == [(10, 20), (10, 21), (11, 20), (11, 21)]


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 64))
def test_pair_order_is_every_correct_wrong_pair_once(g: int, w: int, cap: int) -> None:
    from pagedrl.train.rl.pairs import pair_order

    good, bad = [2 * i for i in range(g)], [2 * i + 1 for i in range(w)]
    pairs = pair_order(good, bad)
    assert sorted(pairs) == sorted((c, r) for c in good for r in bad)  # all g x w, none twice
    kept = pairs[:cap]
    # A cap never skips a completion for a pair reusing one: the completions used are the first ones.
    used_good, used_bad = {c for c, _ in kept}, {r for _, r in kept}
    assert used_good == set(good[:len(used_good)]) and used_bad == set(bad[:len(used_bad)])
