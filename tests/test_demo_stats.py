"""The demo's statistics against values worked out by hand (float64) and published ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedrl.demo.stats import compare, fixed_needed, mcnemar_exact, wilson_interval


def test_wilson_interval_matches_hand_computed_and_published_values() -> None:
    z2 = 1.959963984540054**2
    # 0 of 10 and 10 of 10: the bounds reduce to z^2 / (n + z^2) and n / (n + z^2).
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)), abs=1e-12)
    assert wilson_interval(10, 10) == pytest.approx((10 / (10 + z2), 1.0), abs=1e-12)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    # Newcombe (1998), Statistics in Medicine 17:857, table I: 81/263 and 15/148.
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)


def test_mcnemar_exact_matches_hand_computed_values() -> None:
    assert mcnemar_exact(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 2**12)
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(1, 5) == pytest.approx(2 * 7 / 64)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert fixed_needed(0) == 6  # 5 fixed, none broken: p = 2/32 = 0.0625; 6: 2/64 < 0.05
    assert fixed_needed(2) == 10 and mcnemar_exact(9, 2) >= 0.05 > mcnemar_exact(10, 2)


@given(st.integers(0, 60), st.integers(0, 60))
def test_mcnemar_is_symmetric_and_a_probability(fixed: int, broken: int) -> None:
    p = mcnemar_exact(fixed, broken)
    assert p == mcnemar_exact(broken, fixed) and 0.0 < p <= 1.0
    # The same tail summed in floats as binomial probabilities (log space, an independent route).
    n = fixed + broken
    if n:
        tail = sum(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) - n * math.log(2))
                   for k in range(min(fixed, broken) + 1))
        assert p == pytest.approx(min(1.0, 2 * tail), rel=1e-9)
    assert mcnemar_exact(fixed + 1, broken) <= p or fixed < broken  # more fixed: stronger evidence


@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_interval_contains_the_estimate(case: tuple[int, int]) -> None:
    k, n = case
    low, high = wilson_interval(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0 and high - low < 1.0


def test_compare_counts_discordant_problems() -> None:
    before = [1, 1, 0, 0, 0, 0, 1, 0]
    after = [1, 0, 1, 1, 1, 0, 1, 1]
    c = compare(before, after)
    assert (c.n, c.correct_before, c.correct_after, c.fixed, c.broken) == (8, 3, 6, 4, 1)
    assert c.p_value == pytest.approx(2 * (1 + 5) / 32) and c.verdict == "not significant" and not c.significant
    worse = compare([1] * 12, [0] * 12)
    assert worse.verdict == "significantly worse" and not worse.significant
    better = compare([0] * 12, [1] * 12)
    assert better.significant and better.to_dict()["verdict"] == "significant"
    with pytest.raises(ValueError, match="same problems"):
        compare([1, 0], [1])
