"""The demo's verdict: the seed's trade-offs between GRPO, DPO and RLHF, stated from the run's own
numbers. Each method's before -> after change on the held-out problems gets its intervals and a
paired test (`train/significance.py`); the verdict then says which method gained most per training
minute, per sample generated and per GiB of peak memory, and what each needed to get there.

A method whose change is not significant is not ranked as if it had gained: its gain counts as
zero in the rankings, and the report says how many more minutes its own curve suggests it would
need (`minutes_needed`), or that its curve does not rise at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedrl.train.significance import PairedComparison, fixed_needed

NEEDS = {"GRPO": "prompts and a verifier; no pairs, no reward model, no critic",
         "DPO": "labelled pairs and a frozen reference; no reward model, no sampling while training",
         "RLHF": "labelled pairs for a reward model, then a reference, that reward model and a critic while "
                 "PPO samples"}


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares accuracy gained per minute over a curve's (minutes, accuracy) points."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in points) / var


def minutes_needed(test: PairedComparison, points: Sequence[tuple[float, float]]) -> float | None:
    """Training minutes at which the curve's trend reaches a significant gain, holding the
    problems it broke at today's count: the fewest fixed problems McNemar's test would accept,
    as an accuracy, reached along the least-squares line through the curve. None when the line
    does not rise."""
    rate = slope(points)
    if rate <= 0:
        return None
    target = (test.correct_before + fixed_needed(test.broken) - test.broken) / test.n
    now_x, now_y = points[-1]
    return max(now_x, now_x + (target - now_y) / rate)


def rankings(methods: Mapping[str, Mapping[str, Any]], tests: Mapping[str, PairedComparison]) -> dict[str, Any]:
    """Accuracy points gained (significant changes only) per training minute, per sample generated
    and per GiB of peak memory, with the best method of each."""
    out: dict[str, Any] = {}
    for key, field in (("per training minute", "training time (min)"), ("per sample generated", "samples generated"),
                       ("per GiB of peak memory", "peak memory (GiB)")):
        values = {}
        for name, m in methods.items():
            gain = 100 * (m["accuracy after"] - m["accuracy before"]) if tests[name].significant else 0.0
            values[name] = gain / m[field] if m[field] else 0.0
        best = max(values, key=lambda n: values[n])
        out[key] = {"points": values, "best": best if values[best] > 0 else None}
    return out


def verdict_lines(methods: Mapping[str, Mapping[str, Any]], tests: Mapping[str, PairedComparison],
                  curves: Mapping[str, Sequence[tuple[float, float]]],
                  budget_minutes: float | Mapping[str, float]) -> list[str]:
    """The verdict under the tables, one sentence per line. `budget_minutes`: the methods' common
    budget, or each method's training minutes where the budgets were steps."""
    lines = []
    for name, t in tests.items():
        minutes_had = budget_minutes if isinstance(budget_minutes, float | int) else budget_minutes[name]
        before, after = t.correct_before / t.n, t.correct_after / t.n
        line = (f"{name}: {before:.1%} -> {after:.1%} on {t.n} problems ({t.fixed} fixed, {t.broken} broken; "
                f"McNemar p = {t.p_value:.2g}): {t.verdict}.")
        if not t.significant:
            minutes = minutes_needed(t, curves[name])
            needed = "" if minutes is None else f"{minutes:.1f}" if minutes < 10 else f"{minutes:.0f}"
            line += (f" Its curve does not rise within its {minutes_had:.2g} minutes, so more of the same would not "
                     "be expected to help; its settings would have to change." if minutes is None else
                     f" Along the least-squares trend of its own evaluations it would need about {needed} "
                     f"training minutes to be significant (it had {minutes_had:.2g}); a trend through noisy "
                     "points, a guide rather than a promise.")
        lines.append(line)
    for key, r in rankings(methods, tests).items():
        points = ", ".join(f"{n} {v:.3g}" for n, v in r["points"].items())
        best = f"{r['best']} gained most" if r["best"] else "no method gained significantly"
        lines.append(f"Accuracy points {key}: {best} ({points}).")
    lines.append("What each needed: " + "; ".join(f"{n}, {NEEDS[n]}" for n in methods) + ".")
    return lines
