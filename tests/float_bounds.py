"""Error bounds of float32 arithmetic, for tolerances that follow from the computation rather than from
one machine's run: a sum in any order (a CPU of another class reduces in other lanes) stays within
them. Standard results (Higham, Accuracy and Stability of Numerical Algorithms, ch. 3-4): each
float32 operation is exact to within a relative U; a sum of n terms in any order is off by at most
gamma(n - 1) times the sum of the terms' magnitudes."""

from __future__ import annotations

import torch

U = 2.0**-24  # float32's unit roundoff: half an ulp, relative
EXP_ERROR = 2e-7  # relative error of the exponentials in play (torch's vectorised exp, the kernels' polynomial)


def gamma(n: int) -> float:
    """Relative error bound of n float32 roundings in a chain: n U / (1 - n U)."""
    return n * U / (1 - n * U)


def sum_bound(magnitudes: torch.Tensor, terms: int, dim: int = -1) -> torch.Tensor:
    """Bound on a float32 sum's error in any order: gamma(terms - 1) * sum |x| (over `dim`)."""
    return gamma(max(terms - 1, 1)) * magnitudes.double().abs().sum(dim)


def log_softmax_bound(logits: torch.Tensor, picked: torch.Tensor, summed: int | None = None) -> torch.Tensor:
    """Bound on |float32 log_softmax(logits)[r, picked[r]] - exact| for rows of float32 logits [R, V],
    computed as (x - m) - log(sum exp(x - m)) with the sum's partial sums in float32 over at most
    `summed` terms each (any order; None: the whole row). Terms: the subtraction x_i - m, each
    exponential's argument (relative error up to U |x_j - m|) and value (EXP_ERROR), the sum (relative
    gamma), the log and the final subtraction (U each, relative to their values)."""
    x = logits.double()
    m = x.max(-1, keepdim=True).values
    shifted = (x - m).abs()
    log_sum = torch.logsumexp(x - m, -1)
    value = (x.gather(1, picked[:, None]).squeeze(1) - m.squeeze(1) - log_sum).abs()
    relative_sum = gamma(max((summed or x.shape[-1]) - 1, 1)) + EXP_ERROR + U * shifted.max(-1).values
    return (U * shifted.gather(1, picked[:, None]).squeeze(1) + relative_sum * (1 + 2 * relative_sum)
            + U * log_sum.abs() + U * value) * 1.001
