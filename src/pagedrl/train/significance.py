"""Held-out accuracy with its uncertainty: a 95% interval for each accuracy and a paired test for
each before -> after change, computed from per-problem outcomes so anyone can recompute them.

Accuracy on n held-out problems is a binomial proportion: Wilson's score interval stays inside
[0, 1] and keeps its coverage at the small n and the 10-30% accuracies the demo starts from, where
the normal approximation does not. Before and after are measured on the *same* problems, so the
right test is a paired one: McNemar's exact test looks only at the discordant problems (fixed by
training: b, broken by it: c) and asks how likely a split at least this uneven is if fixing and
breaking were equally likely (b ~ Binomial(b + c, 1/2)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
ALPHA = 0.05


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion `successes / n` (95% by default)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 or n the bound is exactly 0 or 1; the two terms cancel only up to rounding.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def mcnemar_exact(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value: 2 P(X <= min(b, c)) for X ~ Binomial(b + c, 1/2), at most
    1 (and 1 when no problem changed)."""
    if fixed < 0 or broken < 0:
        raise ValueError(f"counts must be >= 0, got fixed={fixed}, broken={broken}")
    n = fixed + broken
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(fixed, broken) + 1))
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True)
class PairedComparison:
    """Before -> after on the same problems."""

    n: int
    correct_before: int
    correct_after: int
    fixed: int  # wrong before, right after
    broken: int  # right before, wrong after
    p_value: float
    interval_before: tuple[float, float]
    interval_after: tuple[float, float]

    @property
    def significant(self) -> bool:
        """An improvement at the 5% level (a significant drop is not one)."""
        return self.p_value < ALPHA and self.fixed > self.broken

    @property
    def verdict(self) -> str:
        if self.p_value >= ALPHA:
            return "not significant"
        return "significant" if self.fixed > self.broken else "significantly worse"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "significant": self.significant, "verdict": self.verdict}


def compare(before: Sequence[bool | int], after: Sequence[bool | int]) -> PairedComparison:
    """Wilson intervals for both accuracies and McNemar's exact test between them; `before[i]` and
    `after[i]` are the same problem's outcomes."""
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} outcomes and after {len(after)}: they must be the same problems")
    b, a = [bool(x) for x in before], [bool(x) for x in after]
    fixed = sum(1 for x, y in zip(b, a, strict=True) if y and not x)
    broken = sum(1 for x, y in zip(b, a, strict=True) if x and not y)
    n = len(b)
    return PairedComparison(n=n, correct_before=sum(b), correct_after=sum(a), fixed=fixed, broken=broken,
                            p_value=mcnemar_exact(fixed, broken), interval_before=wilson_interval(sum(b), n),
                            interval_after=wilson_interval(sum(a), n))


def fixed_needed(broken: int, alpha: float = ALPHA) -> int:
    """The fewest fixed problems that make a change significant when `broken` problems broke."""
    fixed = broken + 1
    while mcnemar_exact(fixed, broken) >= alpha:
        fixed += 1
    return fixed
