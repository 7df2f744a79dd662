"""The trainers' one log-prob helper: targets' log-probs under the rollout's distribution, and the
logged entropy, against float64 computed by hand."""

from __future__ import annotations

import pytest
import torch

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
    logits = (hidden[0, predict_at] @ weight.t())
    targets = logits.argsort(-1, descending=True)[:, 1]  # kept by top-5 too
    out = logprobs_from_hidden(lambda h: h @ weight.t(), hidden, predict_at, targets, params, entropy=True,
                               chunk_rows=2)
    temperature = 1.0 if params is None else params.temperature
    scaled = logits.double() / temperature
    if params is not None and params.top_k > 0:
        kth = scaled.topk(params.top_k, -1).values[:, -1:]
        truncated = scaled.masked_fill(scaled < kth, float("-inf"))
        expected_logp = torch.log_softmax(truncated, -1).gather(1, targets[:, None])[:, 0]
    else:
        expected_logp = torch.log_softmax(scaled, -1).gather(1, targets[:, None])[:, 0]
    p = torch.softmax(scaled, -1)
    expected_entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(out.logps.double(), expected_logp, atol=1e-5, rtol=0)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), expected_entropy, atol=1e-5, rtol=0)


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
    scaled = (h64[0, predict_at] @ w64.t()) / (1.0 if params is None else params.temperature)
    if params is not None and params.top_k > 0:
        kth = scaled.detach().topk(params.top_k, -1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    expected = torch.log_softmax(scaled, -1).gather(1, targets[:, None])[:, 0]
    (expected * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)
