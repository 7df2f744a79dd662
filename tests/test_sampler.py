"""Sampler and the log-prob contract, against float64 hand computations written per token
(`sampler_reference.py`: each truncation defined independently of the implementation)."""

import math

import pytest
import torch
from float_bounds import log_softmax_bound, logprob_bounds
from sampler_reference import (
    assert_logprobs_close,
    bounds_of,
    decided,
    penalty_error,
    random_settings,
    ref_logprobs,
    ref_penalise,
    ref_probs,
)

from pagedrl.engine.logits_processing import apply_penalties, process_logits, processed_logprobs, token_counts
from pagedrl.engine.sampler import Sampler, SamplingRow, make_generator
from pagedrl.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ------------------------------------------------------------------ processing against reference


def test_temperature_only_is_a_scaled_softmax():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 0.0, 1.0, -1.0]])
    ids = torch.tensor([3, 1])
    got = processed_logprobs(logits, ids, temperature=torch.tensor([0.5, 2.0]))
    for row, t, tok, g in zip(logits.tolist(), [0.5, 2.0], ids.tolist(), got.tolist(), strict=True):
        probs, _ = ref_probs(row, temperature=t)
        assert abs(g - math.log(probs[tok])) <= logprob_bounds(torch.tensor([row], dtype=torch.float64), 0.0, t)[0, tok]


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    out = process_logits(logits, top_k=2).tolist()[0]
    assert [v > -math.inf for v in out] == [True, False, True, True, False]
    assert_logprobs_close(torch.log_softmax(torch.tensor(out), -1).tolist(),
                          ref_logprobs(ref_probs(logits[0].tolist(), top_k=2)[0]), logits[0].tolist())


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [True, False, False, False, False]),   # 0.4 alone reaches 0.3
    (0.5, [True, True, True, False, False]),     # needs one 0.2: its twin stays too
    (0.65, [True, True, True, False, False]),
    (0.85, [True, True, True, True, True]),      # needs one 0.1: the other 0.1 stays too
])
def test_top_p_cumulative_cut_keeps_ties_at_the_boundary(top_p, kept):
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]).log()
    out = process_logits(logits, top_p=top_p)[0]
    assert (out > -math.inf).tolist() == kept
    expected, _ = ref_probs(logits[0].tolist(), top_p=top_p)
    assert_logprobs_close(torch.log_softmax(out, -1).tolist(), ref_logprobs(expected), logits[0].tolist())


def test_top_p_is_computed_after_temperature_and_top_k():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()

    def kept(**settings):
        return (process_logits(logits, **settings)[0] > -math.inf).tolist()

    assert kept(top_p=0.55) == [True, True, False, False]  # 0.4 < 0.55 <= 0.7
    assert kept(top_k=2, top_p=0.55) == [True, False, False, False]  # top-k renormalises: 4/7 >= 0.55
    assert kept(temperature=0.25, top_p=0.55) == [True, False, False, False]  # 0.4^4 holds 72%


def test_min_p_compares_to_the_most_likely_token():
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    out = process_logits(logits, min_p=0.25)[0]
    assert (out > -math.inf).tolist() == [True, True, True, False]  # 0.1 < 0.25 * 0.5
    expected, _ = ref_probs(logits[0].tolist(), min_p=0.25)
    assert_logprobs_close(torch.log_softmax(out, -1).tolist(), ref_logprobs(expected), logits[0].tolist())


def test_random_rows_with_mixed_settings_match_reference():
    gen = torch.Generator().manual_seed(0)
    rows, settings, checked = 64, [], 0
    logits = torch.randn(rows, 12, generator=gen) * 2
    for _ in range(rows):
        settings.append(random_settings(gen, 12))
    batched = {key: torch.tensor([s[key] for s in settings]) for key in settings[0]}
    logp = torch.log_softmax(process_logits(logits, **batched), -1)
    for i, s in enumerate(settings):
        expected, _ = ref_probs(logits[i].tolist(), **s)
        if not decided(logits[i].tolist(), **s):  # too close to a cut for float32 to decide like float64
            continue
        checked += 1
        assert_logprobs_close(logp[i].tolist(), ref_logprobs(expected), logits[i].tolist(), s["temperature"])
    assert checked > 48


def test_greedy_rows_are_untruncated_and_unscaled():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = process_logits(logits, temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)
    assert torch.equal(out, logits)


def test_a_vanishing_repetition_penalty_keeps_logits_finite():
    """1e-96 is 0 in float32: seen tokens must get the largest finite logit (or the most negative),
    never inf or NaN, and a masked (-inf) token stays masked."""
    logits = torch.tensor([[2.0, -1.0, float("-inf"), 0.5]])
    seen = torch.tensor([[True, True, True, False]])
    got = apply_penalties(logits, seen, torch.zeros(1, 4), torch.zeros(1), torch.zeros(1),
                          torch.tensor([4.9e-96]))
    assert 1e38 <= got[0, 0] <= torch.finfo(torch.float32).max and -1e-30 <= got[0, 1] <= 0 and got[0, 3] == 0.5
    assert got[0, 2] == float("-inf")


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_follow_vllm_formulas(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.25, 0.0, 1.5], [1.0, 1.0, -2.0, 3.0, -0.5, 0.2]],
                          device=device)
    prompts, outputs = [[0, 1], [5, 5, 2]], [[1, 1, 2, 4], []]
    presence, frequency, repetition = [0.5, -1.0], [0.25, 2.0], [1.3, 0.8]
    got = apply_penalties(logits, token_counts(prompts, 6, device) > 0, token_counts(outputs, 6, device),
                          torch.tensor(presence, device=device), torch.tensor(frequency, device=device),
                          torch.tensor(repetition, device=device))
    for i in range(2):
        expected = ref_penalise(logits[i].tolist(), prompts[i], outputs[i], presence[i], frequency[i],
                                repetition[i])
        bound = penalty_error(logits[i].tolist(), prompts[i], outputs[i], presence[i], frequency[i], repetition[i])
        assert all(abs(g - e) <= b for g, e, b in zip(got[i].tolist(), expected, bound, strict=True))


def test_token_counts_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="token_ids"):
        token_counts([[1, 6]], 6, "cpu")


def test_processed_logprobs_checks_shapes():
    with pytest.raises(ValueError, match="token_ids"):
        processed_logprobs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="top_p"):
        processed_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), top_p=torch.ones(3))


def test_processed_logprobs_gradient_is_the_truncated_softmax_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 10, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    temperature, top_k, top_p = torch.tensor([0.7, 1.0, 1.5], dtype=torch.float64), 6, 0.8
    kept = process_logits(logits.detach(), temperature, top_k, top_p) > -math.inf
    ids = torch.stack([row.nonzero()[0, 0] for row in kept])  # a kept token per row
    processed_logprobs(logits, ids, temperature, top_k, top_p).sum().backward()
    q = torch.softmax(process_logits(logits.detach(), temperature, top_k, top_p), -1)
    expected = (torch.nn.functional.one_hot(ids, 10) - q) / temperature[:, None]
    assert torch.allclose(logits.grad, expected, atol=1e-12)  # float64, a few operations on values below 1


# ------------------------------------------------------------------ the sampler


def full_processed(sampler, logits, rows):
    """Run the sampler asking for every alternative in processed mode: its whole distribution."""
    vocab = logits.shape[1]
    rows = [SamplingRow(r.params.clone(logprobs=vocab, logprobs_mode="processed_logprobs"),
                        r.prompt_token_ids, r.output_token_ids, r.generator, r.banned_token_ids)
            for r in rows]
    out = sampler(logits, rows)
    return out, [[top[t] for t in range(vocab)] for top in out.top_logprobs]


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_distribution_matches_reference_end_to_end(device):
    gen = torch.Generator().manual_seed(2)
    vocab, rows, cases = 10, [], []
    logits = torch.randn(24, vocab, generator=gen) * 2
    for i in range(24):
        s = random_settings(gen, vocab) if i % 4 else dict(temperature=0.0)
        pen = dict(presence_penalty=0.3, frequency_penalty=-0.2, repetition_penalty=1.4) if i % 3 == 0 else {}
        prompt, output, banned = [i % vocab, 3], [1, 1, (2 * i) % vocab], [(i + 5) % vocab] if i % 2 else []
        rows.append(SamplingRow(SamplingParams(**s, **pen), prompt, output, banned_token_ids=banned))
        penalties = (pen.get("presence_penalty", 0.0), pen.get("frequency_penalty", 0.0),
                     pen.get("repetition_penalty", 1.0))
        penalised = ref_penalise(logits[i].tolist(), prompt, output, *penalties)
        error = penalty_error(logits[i].tolist(), prompt, output, *penalties)
        cases.append((ref_probs(penalised, **s, banned=banned)[0], penalised, error, s, banned))
    out, dists = full_processed(Sampler(), logits.to(device), rows)
    raw = torch.log_softmax(logits.double(), -1)
    checked = 0
    for i, (expected, penalised, error, s, banned) in enumerate(cases):
        tok = int(out.token_ids[i])
        assert expected[tok] > 0, "sampled a token outside the kept set"
        assert abs(out.raw_logprobs[i].item() - raw[i, tok].item()) <= log_softmax_bound(logits[i:i + 1], out.token_ids[i:i + 1].cpu())
        bounds = bounds_of(ref_logprobs(expected), penalised, s["temperature"], error)
        assert abs(out.processed_logprobs[i].item() - dists[i][tok]) <= 2 * bounds[tok]  # two float32 ones
        if decided(penalised, **s, banned=banned, error=error):
            checked += 1
            assert_logprobs_close(dists[i], ref_logprobs(expected), penalised, s["temperature"], error)
    assert checked > 18


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_logprob_equals_trainer_recompute(device):
    gen = torch.Generator().manual_seed(3)
    vocab, n = 32, 40
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(device)
    settings = [random_settings(gen, vocab) if i % 5 else dict(temperature=0.0) for i in range(n)]
    rows = [SamplingRow(SamplingParams(**s), generator=make_generator(i, device) if i % 2 else None)
            for i, s in enumerate(settings)]
    out = Sampler()(logits, rows)
    recompute = processed_logprobs(
        logits, out.token_ids, **{k: torch.tensor([s.get(k, d) for s in settings], device=device)
                                  for k, d in [("temperature", 1.0), ("top_k", 0), ("top_p", 1.0),
                                               ("min_p", 0.0)]})
    assert torch.isfinite(out.processed_logprobs).all()
    # two float32 computations of each row's log-prob: within twice float32's bound of it, where the
    # kept set is decided (elsewhere the sampler and the trainer might keep other tokens)
    checked = 0
    for i, s in enumerate(settings):
        row = logits[i].tolist()
        if not decided(row, **s):
            continue
        checked += 1
        kept = process_logits(logits[i:i + 1].double(), **{k: v for k, v in s.items()})[0]
        bound = bounds_of(torch.log_softmax(kept, -1).tolist(), row, s["temperature"])[int(out.token_ids[i])]
        assert abs(out.processed_logprobs[i].item() - recompute[i].item()) <= 2 * bound
    assert checked > 30
    # Penalised rows agree too when the trainer is handed the penalised logits.
    p = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.5, frequency_penalty=0.5)
    row = SamplingRow(p, [1, 2, 3], [3, 3, 7])
    single = Sampler()(logits[:1], [row])
    penalised = apply_penalties(logits[:1], token_counts([[1, 2, 3]], vocab, device) > 0,
                                token_counts([[3, 3, 7]], vocab, device), torch.tensor([0.0], device=device),
                                torch.tensor([0.5], device=device), torch.tensor([1.5], device=device))
    again = processed_logprobs(penalised, single.token_ids, 0.8, 0, 0.9)
    exact = ref_penalise(logits[0].tolist(), [1, 2, 3], [3, 3, 7], 0.0, 0.5, 1.5)
    error = penalty_error(logits[0].tolist(), [1, 2, 3], [3, 3, 7], 0.0, 0.5, 1.5)
    assert decided(exact, 0.8, top_p=0.9, error=error)
    bound = bounds_of(ref_logprobs(ref_probs(exact, 0.8, top_p=0.9)[0]), exact, 0.8, error)[int(single.token_ids[0])]
    assert abs(single.processed_logprobs.item() - again.item()) <= 2 * bound


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_do_not_depend_on_batch_composition_or_order(device):
    gen = torch.Generator().manual_seed(4)
    vocab, steps = 50, 6
    step_logits = [torch.randn(5, vocab, generator=gen).to(device) for _ in range(steps)]
    params = [SamplingParams(seed=11, top_p=0.95), SamplingParams(seed=12, temperature=0.7, top_k=20),
              SamplingParams(temperature=0.0, seed=13), SamplingParams(), SamplingParams(min_p=0.05)]

    def run(order):
        """Sample `steps` steps with the requests in `order`; return each request's tokens."""
        gens = {i: make_generator(params[i].seed, device) for i in order if params[i].seed is not None}
        tokens = {i: [] for i in order}
        for logits in step_logits:
            rows = [SamplingRow(params[i], generator=gens.get(i)) for i in order]
            out = Sampler()(logits[order], rows)
            for i, t in zip(order, out.token_ids.tolist(), strict=True):
                tokens[i].append(t)
        return tokens

    alone = {i: run([i])[i] for i in (0, 1, 2)}
    for order in ([0, 1, 2, 3, 4], [4, 2, 3, 1, 0], [3, 1, 0], [2, 0]):
        got = run(order)
        for i in (0, 1, 2):
            if i in got:
                assert got[i] == alone[i], (order, i)


def test_greedy_picks_the_first_argmax_and_consumes_no_randomness():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 1.0, 0.0, 4.0]])
    own = make_generator(5)
    shared = torch.Generator().manual_seed(9)
    own_state, shared_state = own.get_state(), shared.get_state()
    rows = [SamplingRow(SamplingParams(temperature=0.0, seed=5), generator=own),
            SamplingRow(SamplingParams(temperature=0.0, top_k=2, top_p=0.1))]
    out = Sampler(shared)(logits, rows)
    assert out.token_ids.tolist() == [1, 0]
    assert torch.equal(own.get_state(), own_state) and torch.equal(shared.get_state(), shared_state)
    assert (out.processed_logprobs - torch.log_softmax(logits, -1).max(-1).values).abs().double().le(
        2 * log_softmax_bound(logits, out.token_ids)).all()  # two float32 log_softmaxes of the rows


def test_greedy_applies_penalties_and_bans_first():
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0]])
    penalised = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [])
    banned = SamplingRow(SamplingParams(temperature=0.0), banned_token_ids=[0, 1])
    out = Sampler()(logits.repeat(2, 1), [penalised, banned])
    assert out.token_ids.tolist() == [1, 2]


def chi_square(counts, probs, draws):
    return sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_the_processed_distribution(seeded):
    logits = torch.tensor([1.2, 0.9, 0.4, 0.3, -0.5, -1.0, -3.0, 0.35])
    settings = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1)
    expected, _ = ref_probs(logits.tolist(), **settings)
    assert decided(logits.tolist(), **settings)
    draws = 4000 if seeded else 20000
    params = SamplingParams(**settings)
    rows = [SamplingRow(params, generator=make_generator(i) if seeded else None) for i in range(draws)]
    out = Sampler(torch.Generator().manual_seed(7))(logits.expand(draws, -1), rows)
    counts = torch.bincount(out.token_ids, minlength=8).tolist()
    assert all(c == 0 for c, p in zip(counts, expected, strict=True) if p == 0)
    dof = sum(p > 0 for p in expected) - 1
    assert chi_square(counts, expected, draws) < dof + 6 * math.sqrt(2 * dof)


def test_banned_ids_are_never_sampled():
    logits = torch.tensor([4.0, 3.5, 0.0, -0.5, -1.0, -1.5])
    draws = 3000
    rows = [SamplingRow(SamplingParams(temperature=1.5), banned_token_ids=[0, 1, 4]) for _ in range(draws)]
    out = Sampler(torch.Generator().manual_seed(8))(logits.expand(draws, -1), rows)
    assert set(out.token_ids.tolist()) == {2, 3, 5}
    expected, _ = ref_probs(logits.tolist(), temperature=1.5, banned=[0, 1, 4])
    bounds = bounds_of(ref_logprobs(expected), logits.tolist(), 1.5)
    for got, t in zip(out.processed_logprobs[:5].tolist(), out.token_ids[:5].tolist(), strict=True):
        assert abs(got - math.log(expected[t])) <= bounds[t]


def test_bad_bans_raise_and_bans_of_everything_mark_the_row():
    logits = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="banned_token_ids"):
        Sampler()(logits, [SamplingRow(SamplingParams(), banned_token_ids=[3])])
    out = Sampler()(logits.repeat(2, 1), [SamplingRow(SamplingParams(), banned_token_ids=[0, 1, 2]),
                                          SamplingRow(SamplingParams(), banned_token_ids=[0])])
    assert torch.isneginf(out.processed_logprobs[0]) and out.token_ids[1] != 0
    with pytest.raises(ValueError, match="logits"):
        Sampler()(logits, [])


def test_top_logprobs_raw_and_processed_modes():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4, 1)
    base = SamplingParams(temperature=0.5, top_k=2, seed=0)
    rows = [SamplingRow(base.clone(logprobs=3), generator=make_generator(0)),
            SamplingRow(base.clone(logprobs=3, logprobs_mode="processed_logprobs"), generator=make_generator(0)),
            SamplingRow(base.clone(logprobs=0), generator=make_generator(0)),
            SamplingRow(base, generator=make_generator(0))]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits[0].double(), -1).tolist()
    assert list(out.top_logprobs[0]) == [0, 1, 2]
    raw_bounds = bounds_of(raw, logits[0].tolist())
    assert all(abs(g - e) <= b for g, e, b in zip(out.top_logprobs[0].values(), raw[:3], raw_bounds[:3], strict=True))
    processed = ref_logprobs(ref_probs(logits[0].tolist(), temperature=0.5, top_k=2)[0])
    # Truncated tokens show -inf; which one fills the third place is not specified.
    assert list(out.top_logprobs[1])[:2] == [0, 1]
    bounds = bounds_of(processed, logits[0].tolist(), 0.5)
    for got, e, b in zip(out.top_logprobs[1].values(), processed[:3], bounds[:3], strict=True):
        assert got == e == -math.inf or abs(got - e) <= b
    assert out.top_logprobs[2] == {} and out.top_logprobs[3] is None
    assert len(set(out.token_ids.tolist())) == 1  # same seed, same logits: same token
