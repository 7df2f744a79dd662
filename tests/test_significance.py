"""Held-out accuracy statistics against values worked out by hand (float64) and published ones; the
demo's verdict built on them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedrl.train.significance import compare, fixed_needed, mcnemar_exact, wilson_interval


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


def test_minutes_needed_follows_the_curve_to_a_significant_gain() -> None:
    from pagedrl.demo.verdict import minutes_needed, slope

    points = [(0.0, 0.20), (1.0, 0.22), (2.0, 0.24)]  # 2 points a minute
    assert slope(points) == pytest.approx(0.02)
    # 100 problems, 20 -> 24 correct with 2 broken: 10 fixed are needed (fixed_needed(2)), so 28.
    test = compare([1] * 20 + [0] * 80, [1] * 18 + [0, 0] + [1] * 6 + [0] * 74)
    assert (test.fixed, test.broken, test.correct_after) == (6, 2, 24)
    assert minutes_needed(test, points) == pytest.approx(2.0 + (0.28 - 0.24) / 0.02)
    assert minutes_needed(test, [(0.0, 0.2), (1.0, 0.2)]) is None  # a flat curve never gets there


def test_verdict_ranks_only_significant_gains() -> None:
    from pagedrl.demo.verdict import rankings, verdict_lines

    base = [0] * 100
    tests = {"GRPO": compare(base, [1] * 30 + [0] * 70), "DPO": compare(base, [1] * 20 + [0] * 80),
             "RLHF": compare(base, [1] * 3 + [0] * 97)}
    methods = {name: {"accuracy before": 0.0, "accuracy after": t.correct_after / 100, "training time (min)": 5.0,
                      "samples generated": samples, "peak memory (GiB)": gib}
               for (name, t), samples, gib in zip(tests.items(), (500, 100, 600), (4.0, 1.0, 8.0), strict=True)}
    r = rankings(methods, tests)
    assert r["per training minute"]["best"] == "GRPO" and r["per training minute"]["points"]["GRPO"] == 6.0
    assert r["per sample generated"]["best"] == "DPO" and r["per sample generated"]["points"]["DPO"] == 0.2
    assert r["per GiB of peak memory"]["points"]["RLHF"] == 0.0  # 3 fixed, none broken: not significant
    curves = {"GRPO": [(0, 0), (5, 0.3)], "DPO": [(0, 0), (5, 0.2)], "RLHF": [(0, 0), (2.5, 0.01), (5, 0.03)]}
    lines = verdict_lines(methods, tests, curves, 5.0)
    assert lines[0].startswith("GRPO: 0.0% -> 30.0% on 100 problems (30 fixed, 0 broken") and "significant." in lines[0]
    assert "RLHF" in lines[2] and "not significant" in lines[2] and "would need about 10 training minutes" in lines[2]
