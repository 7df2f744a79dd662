"""Error bounds of float32 arithmetic, for tolerances that follow from the computation rather than from
one machine's run: a sum in any order (a CPU of another class reduces in other lanes) stays within
them. Standard results (Higham, Accuracy and Stability of Numerical Algorithms, ch. 3-4): each
float32 operation is exact to within a relative U; a sum of n terms in any order is off by at most
gamma(n - 1) times the sum of the terms' magnitudes."""

from __future__ import annotations

import math

import torch

U = 2.0**-24  # float32's unit roundoff: half an ulp, relative
BF16 = 2.0**-8  # bf16's: a rounding to bf16 (8 significant bits) is exact to within 2^-8, relative
EXP_ERROR = 2e-7  # relative error of the exponentials in play (torch's vectorised exp, the kernels' polynomial)


def gamma(n: int) -> float:
    """Relative error bound of n float32 roundings in a chain: n U / (1 - n U)."""
    return n * U / (1 - n * U)


def sum_bound(magnitudes: torch.Tensor, terms: int, dim: int = -1) -> torch.Tensor:
    """Bound on a float32 sum's error in any order: gamma(terms - 1) * sum |x| (over `dim`)."""
    return gamma(max(terms - 1, 1)) * magnitudes.double().abs().sum(dim)


def matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bound on a float32 x @ w.T's error, [..., K] x [N, K]: gamma(K) times the products' magnitudes."""
    return gamma(x.shape[-1]) * (x.double().abs() @ w.double().abs().T)


def log_softmax_bounds(logits: torch.Tensor, summed: int | None = None) -> torch.Tensor:
    """Bound on |float32 log_softmax(logits) - exact| per element, for rows of float32 logits [R, V]
    (entries at -inf, cut by a sampler, are skipped and stay -inf), computed as (x - m) - log(sum
    exp(x - m)) with the sum's partial sums in float32 over at most `summed` terms each (any order;
    None: the whole row). Terms: the subtraction x_i - m, each exponential's argument (relative error
    up to U |x_j - m|) and value (EXP_ERROR), the sum (relative gamma), the log and the final
    subtraction (U each, relative to their values)."""
    x = logits.double()
    kept = torch.isfinite(x)
    m = x.masked_fill(~kept, -torch.inf).max(-1, keepdim=True).values
    shifted = (x - m).abs().masked_fill(~kept, 0)
    log_sum = torch.logsumexp(x - m, -1, keepdim=True)
    terms = kept.sum(-1, keepdim=True) if summed is None else torch.full_like(m, summed)
    relative_sum = (terms - 1).clamp(min=1) * U / (1 - terms * U) + EXP_ERROR + U * shifted.max(-1, keepdim=True).values
    value = (x - m - log_sum).abs().masked_fill(~kept, 0)
    bound = (U * shifted + relative_sum * (1 + 2 * relative_sum) + U * log_sum.abs() + U * value) * 1.001
    return bound.masked_fill(~kept, 0)


def log_softmax_bound(logits: torch.Tensor, picked: torch.Tensor, summed: int | None = None) -> torch.Tensor:
    """`log_softmax_bounds` at one picked entry per row [R]."""
    return log_softmax_bounds(logits, summed).gather(1, picked[:, None]).squeeze(1)


def logprob_bounds(logits: torch.Tensor, error: torch.Tensor | float, temperature: float = 1.0,
                   summed: int | None = None) -> torch.Tensor:
    """Bound on |float32 log_softmax(computed / temperature) - exact log_softmax(logits / temperature)|
    per element [R, V], for computed logits within `error` (per element, or one number) of `logits`
    (exact, float64): log-sum-exp moves by at most the largest error of its inputs, so each log-prob
    by its own and that one; the division rounds once; then log_softmax's own roundings."""
    x = logits.double() / temperature
    kept = torch.isfinite(x)
    error = (torch.as_tensor(error, dtype=torch.float64) / temperature).expand_as(x).masked_fill(~kept, 0)
    if temperature != 1.0:
        error = error + U * x.abs().masked_fill(~kept, 0)
    largest = error.max(-1, keepdim=True).values
    return (error + largest).masked_fill(~kept, 0) + log_softmax_bounds(x, summed)


def entropy_bound(logp: torch.Tensor, error: torch.Tensor, summed: int | None = None) -> torch.Tensor:
    """Bound on |float32 -sum_j exp(l_j) l_j - the exact entropy| per row, for computed log-probs l
    within `error` [R, V] of exact ones `logp` (float64; -inf entries skipped): each term moves by
    p_j |1 + log p_j| times its log-prob's error (first order), is off by an exp's error and a
    product's rounding, and their float32 sum by gamma(summed - 1) of their magnitudes."""
    kept = torch.isfinite(logp)
    lp = logp.double().masked_fill(~kept, 0)
    p = lp.exp().masked_fill(~kept, 0)
    terms = (p * lp).abs()
    n = int(kept.sum(-1).max()) if summed is None else summed
    moved = (p * (1 + lp).abs() * error.double().masked_fill(~kept, 0)).sum(-1)
    return (moved * 1.01 + terms.sum(-1) * (EXP_ERROR + U) * (1 + gamma(n)) + sum_bound(terms, n)
            + U * terms.sum(-1)) * 1.001


def cut_decided(scaled: torch.Tensor, error: torch.Tensor | float, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> torch.Tensor:
    """Per row [R]: whether any float32 logits within `error` of exact temperature-scaled ones
    `scaled` [R, V] keep the same top-k / top-p / min-p set (the sampler's rule: the k largest, then
    the fewest largest whose probabilities reach p, then those within a factor min_p of the top): the
    logits either side of each cut further apart than both can move, the mass before each sorted
    position further from p than the logits' errors (each probability within a factor exp(±2E)),
    softmax's and the cumulative sum's roundings can move it, the top's ratio further from min_p."""
    x = scaled.double()
    V = x.shape[-1]
    E = (torch.as_tensor(error, dtype=torch.float64).expand_as(x)).max(-1).values
    ordered = x.sort(-1, descending=True).values
    k = V if top_k <= 0 or top_k >= V else top_k
    decided = torch.ones(x.shape[0], dtype=torch.bool)
    if k < V:
        decided &= ordered[:, k - 1] - ordered[:, k] > 2 * E
    if top_p < 1.0:
        mass = torch.softmax(ordered[:, :k], -1).cumsum(-1)
        spread = (ordered[:, :1] - ordered[:, :k]).masked_fill(ordered[:, :k].isinf(), 0).max(-1).values
        move = mass * (torch.expm1(2 * E) + 2 * EXP_ERROR + 2 * gamma(V) + U * spread)[:, None]
        decided &= ((mass - top_p).abs() > move).all(-1)
        cut = (mass < top_p).sum(-1).clamp(max=k - 1)
        inside = cut + 1 < V
        gap = ordered.gather(1, cut[:, None])[:, 0] - ordered.gather(1, (cut + 1).clamp(max=V - 1)[:, None])[:, 0]
        decided &= ~inside | (gap > 2 * E)
    if min_p > 0.0:
        shifted = x - x.max(-1, keepdim=True).values
        apart = (shifted - math.log(min_p)).abs() > 2 * E[:, None] + EXP_ERROR + U * shifted.abs()
        decided &= (apart | ~torch.isfinite(shifted)).all(-1)
    return decided


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    store: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """For one float32 query q [D] over float32 keys k [n, D] and values v [n, Dv]: the exact
    softmax(q k^T scale) v (float64) and a bound on a float32 computation's error, in any order and
    any blocking of the keys. Scores: a dot product and the scaling (gamma(D + 1) of the terms'
    magnitudes), each probability moving by at most a factor exp(its score's error + the largest);
    each exponential's argument (U |s_j - m|), value (EXP_ERROR) and a rescale of the running sums
    per later key (an online softmax in blocks as small as one key); the sum of them and the
    division; then the output's sum of n products (gamma(n) of their magnitudes). `store`: the unit
    roundoff of a narrower dtype the probabilities are cast to for that product and the output is
    stored in (float16's 2^-11), else 0: float32 throughout."""
    q, k, v = q.double(), k.double(), v.double()
    n, D = k.shape
    scale = D**-0.5 if scale is None else scale
    scores = scale * (k @ q)
    score_error = gamma(D + 1) * scale * (k.abs() @ q.abs())
    p = torch.softmax(scores, 0)
    spread = scores.max() - scores
    rounded = U * spread + EXP_ERROR + (n - 1) * (EXP_ERROR + U) + U * spread.max()
    moved = torch.expm1(score_error + score_error.max()) + rounded + rounded.max() + gamma(n) + U + store
    out = p @ v
    return out, ((p * moved) @ v.abs() + gamma(n) * (p @ v.abs()) + store * out.abs()) * 1.001
