"""Distillation's divergence (`losses.generalized_jsd`, chunked by `logprobs.divergence_from_hidden`) against
TRL 1.16's `_chunked_divergence_loss` itself, in value and gradient, and against a float64 hand computation.

TRL's function takes hidden states and an LM head: the logits go in as the hidden states with the identity
as the head. Its kernel keeps its buffers in float32; `float64_trl` runs the same function with them (and its
projection) in float64, so the two can agree to 1e-10, and the unchanged function is compared at float32's
rounding."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial

import pytest
import torch
import trl.kernels.chunked_divergence as kernel
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from pagedrl.model.loader import load_model
from pagedrl.train.logprobs import (
    DIVERGENCE_CHUNK_BYTES,
    DIVERGENCE_TENSORS,
    divergence_chunk_rows,
    divergence_from_hidden,
)
from pagedrl.train.losses import aggregate, generalized_jsd

BETAS = (0.0, 0.5, 0.3, 1.0)


class _Float64Torch:
    """torch, but its float32 is float64: the dtype TRL's kernel names for its buffers and accumulators."""

    float32 = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextlib.contextmanager
def float64_trl() -> Iterator[None]:
    def project(tile, hidden_chunk, weight, bias, start, end, dtype):  # TRL's `_project` without its .float()
        torch.mm(hidden_chunk.double(), weight[start:end].double().t(), out=tile)

    saved = kernel.torch, kernel._project, kernel._addmm_fp32
    kernel.torch, kernel._project = _Float64Torch(), project
    kernel._addmm_fp32 = lambda acc, a, b: acc.addmm_(a.double(), b.double())
    try:
        yield
    finally:
        kernel.torch, kernel._project, kernel._addmm_fp32 = saved


def logits_and_mask(seed: int = 0, V: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 5, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(3, 5, V, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    return student, teacher, mask


def trl_loss(student, teacher, mask, beta, temperature, n):
    eye = torch.eye(student.shape[-1], dtype=student.dtype)
    return _chunked_divergence_loss(student, teacher.detach(), eye, eye, mask, beta, num_items_in_batch=n,
                                     temperature=temperature)


def ours(student, teacher, mask, beta, temperature, n):
    per_token = generalized_jsd(student, teacher, beta, temperature)
    return aggregate(per_token, mask, "token_mean", normaliser=torch.tensor(float(n), dtype=torch.float64))


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_loss_and_gradient_are_trls_in_float64(beta: float, temperature: float) -> None:
    student, teacher, mask = logits_and_mask()
    n = 16  # a power of two: TRL casts the loss's gradient 1/n to float32 before its float64 buffers
    theirs_s = student.clone().requires_grad_()
    with float64_trl():
        loss, entropy_sum, n_valid = trl_loss(theirs_s, teacher, mask, beta, temperature, n)
        loss.backward()
    mine_s = student.clone().requires_grad_()
    mine = ours(mine_s, teacher, mask, beta, temperature, n)
    mine.backward()
    assert int(n_valid) == int(mask.sum()) == 11  # of the 16 the whole step (other micro-batches too) holds
    assert abs(float(mine) - float(loss)) < 1e-10 and float(mine) > 1e-3
    assert torch.allclose(mine_s.grad, theirs_s.grad, rtol=0, atol=1e-10)
    logp = torch.log_softmax(student / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert abs(float(entropy[mask.bool()].sum()) - float(entropy_sum)) < 1e-10  # TRL's `entropy` metric


@pytest.mark.parametrize("beta", BETAS)
def test_trls_own_float32_kernel_agrees_to_its_rounding(beta: float) -> None:
    """The function exactly as TRL's trainer calls it (float32 buffers), normalised by 13 tokens over the batch."""
    student, teacher, mask = logits_and_mask(seed=1)
    theirs_s = student.clone().requires_grad_()
    loss, _, _ = trl_loss(theirs_s, teacher, mask, beta, 1.3, 13)
    loss.backward()
    mine_s = student.clone().requires_grad_()
    mine = ours(mine_s, teacher, mask, beta, 1.3, 13)
    mine.backward()
    assert float(mine) == pytest.approx(float(loss), rel=1e-6)
    assert torch.allclose(mine_s.grad, theirs_s.grad, rtol=1e-5, atol=1e-8)


def hand(zs: list[float], zt: list[float], beta: float, temperature: float) -> float:
    """The divergence of one position from its definition, in Python floats."""
    def softmax(z: list[float]) -> list[float]:
        e = [math.exp(v / temperature) for v in z]
        return [v / sum(e) for v in e]

    def kl(p: list[float], q: list[float]) -> float:
        return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))

    ps, pt = softmax(zs), softmax(zt)
    if beta == 0.0:
        return kl(pt, ps)
    if beta == 1.0:
        return kl(ps, pt)
    m = [(1 - beta) * a + beta * b for a, b in zip(ps, pt, strict=True)]
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


@pytest.mark.parametrize("beta", BETAS)
def test_divergence_by_hand_on_a_three_token_vocabulary(beta: float) -> None:
    zs, zt = [[0.3, -1.2, 2.0], [1.0, 1.0, -0.5]], [[1.5, 0.1, -0.7], [0.2, 2.2, 0.0]]
    got = generalized_jsd(torch.tensor(zs, dtype=torch.float64), torch.tensor(zt, dtype=torch.float64), beta, 0.8)
    for i in range(2):
        assert abs(float(got[i]) - hand(zs[i], zt[i], beta, 0.8)) < 1e-12
    assert float(generalized_jsd(torch.tensor(zs), torch.tensor(zs), beta).abs().max()) < 1e-6  # p = q: 0


@pytest.mark.parametrize("beta", BETAS)
def test_gradient_is_the_finite_difference(beta: float) -> None:
    student, teacher, _ = logits_and_mask(seed=2, V=5)
    student = student[0].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda s: generalized_jsd(s, teacher[0], beta, 1.5), (student,))


def test_chunks_change_neither_value_nor_gradient() -> None:
    """`divergence_from_hidden` on 7 rows in chunks of 2 (recomputed in the backward pass) and in one."""
    g = torch.Generator().manual_seed(3)
    head_s, head_t = torch.nn.Linear(4, 9, dtype=torch.float64), torch.nn.Linear(6, 9, dtype=torch.float64)
    hs, ht = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randn(7, 6, generator=g, dtype=torch.float64)
    results = []
    for chunk in (2, 1024):
        head_s.zero_grad()
        rows = hs.clone().requires_grad_()
        div, ent = divergence_from_hidden(head_s, rows, head_t, ht, 0.5, 0.9, chunk_rows=chunk)
        div.sum().backward()
        results.append((div.detach(), ent, rows.grad, head_s.weight.grad.clone()))
        assert head_t.weight.grad is None  # the teacher is frozen
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    expected = generalized_jsd(head_s(hs), head_t(ht), 0.5, 0.9)
    assert torch.allclose(results[0][0], expected, rtol=0, atol=1e-12)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"beta: must lie in \[0, 1\], got 1.5"):
        generalized_jsd(torch.zeros(2, 3), torch.zeros(2, 3), 1.5)
    with pytest.raises(ValueError, match=r"teacher_logits: shape \(2, 4\) differs from the student's \(2, 3\)"):
        generalized_jsd(torch.zeros(2, 3), torch.zeros(2, 4), 0.5)


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_bf16_heads_give_float32_logits_as_trls_projection(tiny_train_model, beta: float) -> None:
    """Under bf16 autocast both heads multiply bf16 operands into float32 logits, as TRL's `_project` does:
    the divergence is TRL's on the same hidden rows to float32's rounding, where logits rounded to bf16 first
    (the plain head) are off by far more."""
    g = torch.Generator().manual_seed(4)
    student, teacher = (load_model(tiny_train_model, dtype=torch.float32).model for _ in range(2))
    with torch.no_grad():
        student.lm_head.weight.copy_(torch.randn(student.lm_head.weight.shape, generator=g) * 0.5)
        teacher.lm_head.weight.copy_(student.lm_head.weight + 0.01 * torch.randn(student.lm_head.weight.shape,
                                                                              generator=g))
    n, h = 48, student.config.hidden_size
    hs = torch.nn.functional.normalize(torch.randn(n, h, generator=g), dim=-1) * h ** 0.5
    ht = hs + 0.05 * torch.randn(n, h, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs, entropy_sum, _ = _chunked_divergence_loss(hs[None], ht[None], student.lm_head.weight,
                                                          teacher.lm_head.weight, torch.ones(1, n), beta,
                                                          num_items_in_batch=n)
        div, ent = divergence_from_hidden(partial(student.logits, float32_out=True), hs,
                                          partial(teacher.logits, float32_out=True), ht, beta)
        rounded, _ = divergence_from_hidden(student.logits, hs, teacher.logits, ht, beta)
    assert float(theirs) > 1e-3
    assert float(div.mean()) == pytest.approx(float(theirs), rel=2e-5)
    assert float(ent.sum()) == pytest.approx(float(entropy_sum), rel=2e-5)
    assert abs(float(rounded.mean()) / float(theirs) - 1) > 1e-3  # what bf16 logits did before


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_a_chunks_tensors_stay_within_the_stated_budget(beta: float) -> None:
    """What autograd keeps for `generalized_jsd`'s backward, counted, plus both heads' logits and the backward's
    gradients: at most DIVERGENCE_TENSORS [rows, vocab] float32 tensors, within budget at a 152k vocabulary."""
    saved: list[int] = []
    rows, vocab = 8, 1000
    student = torch.randn(rows, vocab, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x,
                                                  lambda x: x):
        generalized_jsd(student, torch.randn(rows, vocab), beta, 0.9)
    assert sum(saved) / (rows * vocab * 4) + 2 + 2 <= DIVERGENCE_TENSORS  # + both logits + the backward's grads
    assert divergence_chunk_rows(151936) * 151936 * 4 * DIVERGENCE_TENSORS <= DIVERGENCE_CHUNK_BYTES
    assert divergence_chunk_rows(151936) == 160
