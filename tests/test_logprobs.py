"""The trainers' one log-prob helper: targets' log-probs under the rollout's distribution, and the
logged entropy, against float64 computed by hand."""

from __future__ import annotations

import pytest
import torch
from float_bounds import EXP_ERROR, U, entropy_bound, gamma, logprob_bounds, matmul_bound

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.train.logprobs import logprobs_from_hidden


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.9, top_k=5), None])
def test_logprobs_and_entropy_equal_a_float64_hand_computation(params: SamplingParams | None) -> None:
    """Untruncated rows read their entropy from the log-probs already computed; truncated ones
    (top-k) and the model's own distribution take the separate pass. Both are the entropy of
    softmax(logits / temperature), as TRL logs it."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g) * 2
    hidden = torch.randn(1, 11, 8, generator=g)
    predict_at = torch.tensor([0, 3, 4, 9, 10])
    exact = hidden[0, predict_at].double() @ weight.double().t()
    targets = exact.argsort(-1, descending=True)[:, 1]  # kept by top-5 too
    out = logprobs_from_hidden(lambda h: h @ weight.t(), hidden, predict_at, targets, params, entropy=True,
                               chunk_rows=2)
    temperature = 1.0 if params is None else params.temperature
    scaled = exact / temperature
    truncated = scaled
    logits_error = matmul_bound(hidden[0, predict_at], weight)  # the head's float32 product, K = 8
    if params is not None and params.top_k > 0:
        ranked = scaled.topk(params.top_k + 1, -1).values
        # the kept set is float32's too: the k-th and next logits further apart than both can move
        assert (ranked[:, -2] - ranked[:, -1] > 2 * (logits_error.max() / temperature + 1e-6)).all()
        truncated = scaled.masked_fill(scaled < ranked[:, -2:-1], float("-inf"))
    expected_logp = torch.log_softmax(truncated, -1).gather(1, targets[:, None])[:, 0]
    bound = logprob_bounds(truncated * temperature, logits_error, temperature).gather(1, targets[:, None])[:, 0]
    assert ((out.logps.double() - expected_logp).abs() <= bound).all()
    # the entropy of softmax(logits / temperature) whatever the cut, from float32 log-probs of it
    logp = torch.log_softmax(scaled, -1)
    expected_entropy = -(logp.exp() * logp).sum(-1)
    assert out.entropy is not None
    entropy_error = entropy_bound(logp, logprob_bounds(exact, logits_error, temperature))
    assert ((out.entropy.double() - expected_entropy).abs() <= entropy_error).all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, top_k=5), None])
def test_gradients_through_the_chunked_head_equal_float64(params: SamplingParams | None) -> None:
    """The head run chunk by chunk: the gradients reaching the hidden rows and the head's weight are
    those of float64 autograd over the whole batch, and the values those computed without a
    gradient."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(50, 8, generator=g) * 2).requires_grad_()
    hidden = torch.randn(1, 11, 8, generator=g).requires_grad_()
    predict_at = torch.tensor([0, 3, 4, 9, 10])
    targets = torch.tensor([1, 7, 7, 30, 49])
    upstream = torch.randn(5, generator=g, dtype=torch.float64)
    out = logprobs_from_hidden(lambda h: h @ weight.t(), hidden, predict_at, targets, params, entropy=True,
                               correct=True, mean_logit=True, chunk_rows=2)
    (out.logps.double() * upstream).sum().backward()
    with torch.no_grad():
        plain = logprobs_from_hidden(lambda h: h @ weight.t(), hidden, predict_at, targets, params, entropy=True,
                                     correct=True, mean_logit=True, chunk_rows=2)
    for name in ("logps", "entropy", "correct", "mean_logit"):
        assert torch.equal(getattr(out, name), getattr(plain, name)), name

    w64, h64 = weight.detach().double().requires_grad_(), hidden.detach().double().requires_grad_()
    temperature = 1.0 if params is None else params.temperature
    logits = h64[0, predict_at] @ w64.t()
    scaled = logits / temperature
    if params is not None and params.top_k > 0:
        kth = scaled.detach().topk(params.top_k, -1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logp = torch.log_softmax(scaled, -1)
    (logp.gather(1, targets[:, None])[:, 0] * upstream).sum().backward()
    # Backward in float32: d logits = u (onehot - exp(log p)) / T, with exp(log p) off by its
    # log-prob's error and an exp's, the upstream's cast, the product, the difference and the division
    # a rounding each; then the head's two products, over V = 50 for the rows, over the 5 rows (in
    # chunks, accumulated) for the weight.
    rows, w = hidden.detach()[0, predict_at], weight.detach()
    with torch.no_grad():
        p = logp.exp()
        d_logits = upstream[:, None] * (torch.nn.functional.one_hot(targets, 50) - p) / temperature
        logp_error = logprob_bounds(logits.masked_fill(~torch.isfinite(scaled), float("-inf")), matmul_bound(rows, w),
                                    temperature)
        d_error = (upstream.abs()[:, None] * p * (logp_error + EXP_ERROR + U) / temperature + 4 * U * d_logits.abs()) * 1.01
        hidden_error = torch.zeros_like(h64)  # rows that predict nothing get nothing
        hidden_error[0, predict_at] = d_error @ w.double().abs() + gamma(50) * (d_logits.abs() @ w.double().abs())
        weight_error = d_error.t() @ rows.double().abs() + gamma(5) * (d_logits.abs().t() @ rows.double().abs())
    assert ((hidden.grad.double() - h64.grad).abs() <= hidden_error).all()
    assert ((weight.grad.double() - w64.grad).abs() <= weight_error).all()
