"""Reward functions (verifiers) with TRL's signature:
`f(prompts, completions, completion_ids, **columns) -> list[float | None]`.

`None` means "not applicable to this sample" and is excluded from the baseline, not counted as 0.
Completions are plain strings for plain-text prompts and `[{"role": "assistant", "content": ...}]`
for conversational ones, as in TRL; the built-ins accept both. Users add their own from a file:
`reward_funcs: ["my_rewards.py:correct"]`.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RewardFunc = Callable[..., list[float | None]]

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER = re.compile(r"answer\s*(?:is|:)\s*([^\n]*)", re.IGNORECASE)


def completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise ValueError(f"completion: expected a string or a list of messages, got {type(completion).__name__}")


def normalise_number(text: str) -> str | None:
    """'1,234' → '1234', '+5' → '5', '-0' → '0', '12.0' → '12', '12.50' → '12.5'; None if not a number."""
    text = text.strip().replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    if math.isnan(value) or math.isinf(value):
        return None
    if value == int(value):
        return str(int(value))
    return repr(value)


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return normalise_number(found[-1]) if found else None


def extract_answer(text: str) -> str | None:
    """The final answer: the last `\\boxed{...}`, else the number after the last `Answer:`/`answer is`,
    else the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return last_number(boxed[-1]) or boxed[-1].strip()
    answers = _ANSWER.findall(text)
    if answers and (n := last_number(answers[-1])) is not None:
        return n
    return last_number(text)


def numeric_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] = (),
                  answer: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
    """1.0 when the completion's final number equals the `answer` column, else 0.0."""
    if answer is None:
        raise ValueError("numeric_match needs an 'answer' column in the dataset")
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            out.append(None)
            continue
        got = extract_answer(completion_text(completion))
        out.append(1.0 if got is not None and got == normalise_number(str(expected)) else 0.0)
    return out


def last_integer_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] = (),
                       answer: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
    """The arithmetic task's verifier: 1.0 when the last integer in the completion (commas removed)
    equals the answer."""
    if answer is None:
        raise ValueError("last_integer_match needs an 'answer' column in the dataset")
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        ints = re.findall(r"-?\d+", completion_text(completion).replace(",", ""))
        out.append(1.0 if ints and int(ints[-1]) == int(expected) else 0.0)
    return out


def exact_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] = (),
                answer: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
    """1.0 when the stripped completion equals the stripped `answer` column."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' column in the dataset")
    return [1.0 if completion_text(c).strip() == str(a).strip() else 0.0
            for c, a in zip(completions, answer, strict=True)]


def format_reward(pattern: str) -> RewardFunc:
    """1.0 when the completion matches `pattern` (re.fullmatch, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] = (),
                     **_: Any) -> list[float | None]:
        return [1.0 if compiled.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]

    return format_match


def soft_overlong_penalty(max_completion_length: int, buffer: int) -> RewardFunc:
    """DAPO's soft overlong punishment: 0 up to `max - buffer` tokens, then falling linearly to -1
    at `max` tokens."""
    if not 0 < buffer <= max_completion_length:
        raise ValueError(f"overlong buffer must be in (0, max_completion_length], got {buffer}")
    expected = max_completion_length - buffer

    def overlong_penalty(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] = (),
                         **_: Any) -> list[float | None]:
        out: list[float | None] = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= expected else max(-1.0, (expected - n) / buffer))
        return out

    return overlong_penalty


BUILTINS: dict[str, RewardFunc] = {
    "numeric_match": numeric_match,
    "last_integer_match": last_integer_match,
    "exact_match": exact_match,
}


def load_reward_function(spec: str, *, max_completion_length: int, format_pattern: str | None = None,
                         overlong_buffer: int | None = None) -> tuple[str, RewardFunc]:
    """A built-in name (`numeric_match`, `last_integer_match`, `exact_match`, `format`,
    `overlong_penalty`) or `path/to/file.py:function`. Returns (name for metrics, function)."""
    if spec in BUILTINS:
        return spec, BUILTINS[spec]
    if spec == "format":
        if not format_pattern:
            raise ValueError("reward_funcs: 'format' needs format_pattern (a regular expression)")
        return "format", format_reward(format_pattern)
    if spec == "overlong_penalty":
        buffer = overlong_buffer or max(1, max_completion_length // 4)
        return "overlong_penalty", soft_overlong_penalty(max_completion_length, buffer)
    path_text, sep, func_name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py"):
        known = sorted([*BUILTINS, "format", "overlong_penalty"])
        raise ValueError(f"reward_funcs: {spec!r} is neither a built-in ({', '.join(known)}) "
                         "nor 'file.py:function'")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"reward_funcs: {spec!r}: file {path} not found")
    module_spec = importlib.util.spec_from_file_location(f"pagedrl_user_rewards_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"reward_funcs: {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"reward_funcs: {spec!r}: {path} has no function {func_name!r}")
    return func_name, func


def score(funcs: Sequence[tuple[str, RewardFunc]], prompts: Sequence[Any], completions: Sequence[Any],
          completion_ids: Sequence[Sequence[int]], columns: dict[str, Sequence[Any]]) -> list[list[float]]:
    """Every function on every completion: rows[i][f] (NaN where a function returned None).
    A function that raises or returns the wrong number of values is an error naming it."""
    per_func: list[list[float]] = []
    for name, func in funcs:
        try:
            values = func(prompts=list(prompts), completions=list(completions),
                          completion_ids=[list(c) for c in completion_ids], **columns)
        except Exception as e:
            raise ValueError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"reward function {name!r} returned {got} values for {len(completions)} completions")
        column = []
        for i, v in enumerate(values):
            if v is None:
                column.append(math.nan)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                column.append(float(v))
            else:
                raise ValueError(f"reward function {name!r} returned {v!r} for completion {i}; "
                                 "expected a finite number or None")
        per_func.append(column)
    return [list(row) for row in zip(*per_func, strict=True)]
