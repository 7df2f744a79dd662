"""The sampler's float64 reference, written per token and independently of the implementation: top-p
keeps a token iff the mass of strictly more likely tokens is below p (no sorting, no cumulative sums),
min-p compares probabilities, penalties loop over the vocabulary as vLLM's formulas read; and the
float32 bounds the implementation's numbers are held to (`float_bounds.py`). Used by `test_sampler.py`."""

import math

import torch
from float_bounds import U, cut_decided, logprob_bounds


def ref_penalise(logits, prompt, output, presence, frequency, repetition):
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(t)
        out.append(x - frequency * count - presence * (count > 0))
    return out


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, banned=()):
    """Float64 distribution a token is drawn from; also the smallest distance to a cut."""
    if temperature == 0:
        temperature, top_k, top_p, min_p = 1.0, 0, 1.0, 0.0
    z = [-math.inf if t in banned else x / temperature for t, x in enumerate(logits)]
    keep = [v > -math.inf for v in z]
    if 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, z, strict=True)]
    zmax = max(z)
    weight = [math.exp(v - zmax) if k else 0.0 for k, v in zip(keep, z, strict=True)]
    total = sum(weight)
    q = [w / total for w in weight]
    margin = math.inf
    if top_p < 1.0:
        above = [sum(qj for qj in q if qj > qi) for qi in q]
        margin = min(abs(a - top_p) for a, k in zip(above, keep, strict=True) if k)
        keep = [k and a < top_p for k, a in zip(keep, above, strict=True)]
    if min_p > 0.0:
        ratios = weight  # exp(z - zmax) == q / q_max
        margin = min(margin, min(abs(r - min_p) for r, k in zip(ratios, keep, strict=True) if k))
        keep = [k and r >= min_p for k, r in zip(keep, ratios, strict=True)]
    total = sum(w for w, k in zip(weight, keep, strict=True) if k)
    return [w / total if k else 0.0 for w, k in zip(weight, keep, strict=True)], margin


def ref_logprobs(probs):
    return [math.log(p) if p > 0 else -math.inf for p in probs]


def penalty_error(logits, prompt, output, presence, frequency, repetition):
    """Per token, a bound on float32 `apply_penalties`' error: the repetition's product or division,
    the frequency's product and two subtractions, a rounding each of values at most these."""
    scale = max(repetition, 1 / repetition)
    return [4 * U * (abs(x) * scale + abs(frequency) * output.count(t) + abs(presence)) for t, x in enumerate(logits)]


def bounds_of(expected, logits, temperature=1.0, error=0.0):
    """Per token, float32's bound on a log-prob of the row the reference keeps (-inf where it cuts a
    token): the logits' own errors (`error`: a penalty's roundings) and the row's roundings (the
    temperature's division, log_softmax over the kept tokens: `float_bounds.logprob_bounds`)."""
    kept = torch.tensor([e > -math.inf for e in expected])
    x = torch.tensor(logits, dtype=torch.float64).masked_fill(~kept, -math.inf)[None]
    return logprob_bounds(x, torch.tensor(error, dtype=torch.float64), temperature or 1.0)[0].tolist()


def assert_logprobs_close(actual, expected, logits, temperature=1.0, error=0.0):
    """Float32 log-probs against the float64 reference, within float32's bound (`bounds_of`)."""
    for a, e, b in zip(actual, expected, bounds_of(expected, logits, temperature, error), strict=True):
        if e == -math.inf:
            assert a == -math.inf
        else:
            assert abs(a - e) <= b, (a, e, b)


def decided(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, banned=(), error=0.0):
    """Whether float32 keeps the tokens float64 keeps (`float_bounds.cut_decided` on the scaled row)."""
    if temperature == 0:
        return True
    z = torch.tensor(logits, dtype=torch.float64) / temperature
    z[list(banned)] = -math.inf
    scaled_error = torch.tensor(error, dtype=torch.float64) / temperature + U * z.abs().masked_fill(z.isinf(), 0)
    return bool(cut_decided(z[None], scaled_error, top_k, top_p, min_p)[0])


def random_settings(gen, vocab):
    return dict(temperature=float(torch.empty(1).uniform_(0.3, 2.0, generator=gen)),
                top_k=int(torch.randint(0, vocab + 2, (1,), generator=gen)),
                top_p=float(torch.empty(1).uniform_(0.2, 1.0, generator=gen)),
                min_p=float(torch.empty(1).uniform_(0.0, 0.3, generator=gen)))
