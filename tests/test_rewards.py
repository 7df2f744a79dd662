"""Verifiers and reward-function plumbing."""

from __future__ import annotations

import math

import pytest

from pagedrl.train.rl.arithmetic import ArithmeticTask
from pagedrl.train.rl.rewards import (
    exact_match,
    extract_answer,
    last_integer_match,
    load_reward_function,
    normalise_number,
    numeric_match,
    score,
    soft_overlong_penalty,
)


@pytest.mark.parametrize("text,expected", [
    ("The answer is 1,234.", "1234"), ("so 12.0", "12"), ("+5", "5"), ("-0", "0"), ("x = 12.50", "12.5"),
    ("\\boxed{42} but later 7", "42"), ("Answer: 17\nthen 99", "17"), ("no number", None), ("-3 and -4", "-4"),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_normalise_number() -> None:
    assert normalise_number("1,000.0") == "1000"
    assert normalise_number("abc") is None
    assert normalise_number("nan") is None


def test_numeric_match_plain_and_chat_completions() -> None:
    chat = [[{"role": "assistant", "content": "It is 1,024."}], [{"role": "assistant", "content": "1023"}]]
    assert numeric_match([None, None], chat, answer=["1024", "1024"]) == [1.0, 0.0]
    assert numeric_match([None], ["\\boxed{-7}"], answer=[-7]) == [1.0]
    assert numeric_match([None], ["7"], answer=[None]) == [None]


def test_last_integer_match_is_the_arithmetic_verifier() -> None:
    got = last_integer_match([None] * 4, ["57", "The sum is 1,057", "57 or 58", "fifty-seven"],
                             answer=["57", "1057", "57", "57"])
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_exact_match() -> None:
    assert exact_match([None, None], [" Paris ", "paris"], answer=["Paris", "Paris"]) == [1.0, 0.0]


def test_soft_overlong_penalty_matches_dapo() -> None:
    f = soft_overlong_penalty(max_completion_length=20, buffer=5)
    ids = [[0] * n for n in (10, 15, 16, 18, 20)]
    assert f([None] * 5, [""] * 5, ids) == [0.0, 0.0, -0.2, -0.6, -1.0]


def test_user_reward_file_and_errors(tmp_path) -> None:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def short(prompts, completions, completion_ids, **kw):\n"
        "    return [1.0 if len(c) < 5 else None for c in completions]\n"
        "def broken(prompts, completions, completion_ids, **kw):\n"
        "    raise RuntimeError('boom')\n"
        "def wrong_length(prompts, completions, completion_ids, **kw):\n"
        "    return [1.0]\n")
    name, short = load_reward_function(f"{path}:short", max_completion_length=8)
    rows = score([(name, short)], [None, None], ["hi", "a long one"], [[1], [1, 2, 3]], {})
    assert rows[0] == [1.0] and math.isnan(rows[1][0])  # None: not applicable, kept apart from 0
    with pytest.raises(ValueError, match="reward function 'broken' raised RuntimeError: boom"):
        score([load_reward_function(f"{path}:broken", max_completion_length=8)], [None], ["x"], [[1]], {})
    with pytest.raises(ValueError, match="'wrong_length' returned 1 values for 2 completions"):
        score([load_reward_function(f"{path}:wrong_length", max_completion_length=8)], [None, None],
              ["x", "y"], [[1], [2]], {})
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward_function(f"{path}:missing", max_completion_length=8)
    with pytest.raises(ValueError, match="not found"):
        load_reward_function(f"{tmp_path}/nope.py:f", max_completion_length=8)
    with pytest.raises(ValueError, match="neither a built-in"):
        load_reward_function("accuracy", max_completion_length=8)


def test_arithmetic_task_train_and_eval_never_overlap() -> None:
    task = ArithmeticTask(num_eval=300)
    held = task.eval_rows()
    assert len(held) == 300 and len({r["prompt"][0]["content"] for r in held}) == 300
    assert held == ArithmeticTask(num_eval=300).eval_rows()  # fixed by the seed
    held_prompts = {r["prompt"][0]["content"] for r in held}
    stream = task.train_rows()
    train = [next(stream) for _ in range(3000)]
    assert not held_prompts & {r["prompt"][0]["content"] for r in train}
    first = held[0]
    a, b = (int(x) for x in first["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
    assert 10 <= a <= 99 and 10 <= b <= 99 and first["answer"] == str(a + b)
    assert first["prompt"][0]["content"] == f"What is {a} + {b}? Answer with just the number."
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(operations=("/",))
