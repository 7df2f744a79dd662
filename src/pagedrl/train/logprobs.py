"""The one way every trainer turns a forward pass into per-token log-probs.

forward → the hidden rows that predict a target (`predict_at`) → the LM head on those rows only →
log p(target), and on request the entropy, whether the target is the argmax, and the vocabulary
mean of the logits. The head runs over the rows in chunks, so the [tokens, vocab] float32
intermediates of one chunk at a time are alive beside the logits autograd keeps; a raw log-prob is
`logit[target] − logsumexp(logits)` (TRL's `selective_log_softmax` idea: no log-softmax copy at
all), and the extras are computed per chunk without gradient and dropped.

With a `SamplingParams`, the log-probs are the *processed* ones (temperature, top-k, top-p,
min-p), through the very function the engine samples with (`processed_logprobs`): that is the
logprob contract an online algorithm's ratio rests on, and why the rollout's own params are what
it is called with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrl.engine.logits_processing import processed_log_softmax
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.train.losses import generalized_jsd

CHUNK_ROWS = 1024  # 1024 rows × a 49k vocabulary ≈ 200 MB of float32 logits per chunk
# Distillation's chunk: at 0 < beta < 1 the backward of `generalized_jsd` keeps 7 [rows, vocab] float32 tensors
# (2 at beta 0, 4 at 1; counted in tests/test_distill_loss.py) beside both heads' logits, and the backward's
# gradients add about 2 more: a 512 × 32768 chunk's forward and backward peaked at 10.3 such tensors at beta 0.5.
# Its rows are sized from the vocabulary to keep 11 of them within this budget (160 rows at a 152k vocabulary,
# 496 at 49k).
DIVERGENCE_CHUNK_BYTES = 1 << 30
DIVERGENCE_TENSORS = 11


def divergence_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of `divergence_from_hidden` whose [rows, vocab] float32 tensors fit DIVERGENCE_CHUNK_BYTES."""
    return max(1, DIVERGENCE_CHUNK_BYTES // (DIVERGENCE_TENSORS * 4 * vocab_size))


@dataclass
class TargetLogprobs:
    logps: torch.Tensor  # [N] log p(target), with gradient when the forward has one
    entropy: torch.Tensor | None = None  # [N] of the (temperature-scaled) distribution, no gradient
    correct: torch.Tensor | None = None  # [N] bool: the target is the argmax
    mean_logit: torch.Tensor | None = None  # [N] vocabulary mean of the raw logits, no gradient
    log_sum_sq: torch.Tensor | None = None  # [N] log Σ_v p_v² of the raw distribution (WPO's), no gradient


def target_logprobs(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                    predict_at: torch.Tensor, targets: torch.Tensor, sampling: SamplingParams | None = None,
                    entropy: bool = False, correct: bool = False, mean_logit: bool = False,
                    chunk_rows: int = CHUNK_ROWS, log_sum_sq: bool = False) -> TargetLogprobs:
    """Log-probs of `targets` [N] predicted by the hidden rows `predict_at` [N] (indices into the
    flattened [B·T] positions) after one forward of `model` (the trained module through the
    loop's handle, or a frozen copy). `sampling`: the distribution the targets were drawn from;
    None means the model's own (temperature 1, nothing cut)."""
    hidden = model(input_ids, positions=positions, meta=meta)
    return logprobs_from_hidden(model.logits, hidden, predict_at, targets, sampling, entropy, correct, mean_logit,
                                chunk_rows, log_sum_sq)


def logprobs_from_hidden(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, predict_at: torch.Tensor,
                         targets: torch.Tensor, sampling: SamplingParams | None = None, entropy: bool = False,
                         correct: bool = False, mean_logit: bool = False,
                         chunk_rows: int = CHUNK_ROWS, log_sum_sq: bool = False) -> TargetLogprobs:
    """`target_logprobs` after the forward: for a caller whose one forward feeds more than the LM
    head (PPO's policy and value head in one pass)."""
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, predict_at)
    processed = sampling is not None and not sampling.is_greedy
    temperature = sampling.temperature if processed and sampling is not None else 1.0
    # Without truncation the processed distribution is softmax(logits / temperature), whose entropy
    # is what is logged: it is read from the same log-probs rather than from a second pass.
    untruncated = processed and sampling is not None and sampling.top_k in (0, -1) and sampling.top_p >= 1.0 \
        and not sampling.min_p
    parts: dict[str, list[torch.Tensor]] = {"logps": [], "entropy": [], "correct": [], "mean_logit": [],
                                            "log_sum_sq": []}
    for start in range(0, rows.shape[0], chunk_rows):
        logits = head(rows[start:start + chunk_rows]).float()
        t = targets[start:start + chunk_rows]
        full = None
        if processed:
            assert sampling is not None  # the engine's own function: the logprob contract, bit for bit
            full = processed_log_softmax(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                         sampling.min_p)
            lp = full.gather(1, t[:, None]).squeeze(1)
        else:
            lp = logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(-1)
        parts["logps"].append(lp)
        with torch.no_grad():
            if entropy and untruncated and full is not None:
                logp = full.detach()  # finite: no token is cut from an untruncated distribution
                parts["entropy"].append(entropy_from_logprobs(logp))
            elif entropy:
                parts["entropy"].append(entropy_from_logits(logits / temperature))
            if correct:
                parts["correct"].append(logits.argmax(-1) == t)
            if mean_logit:
                parts["mean_logit"].append(logits.mean(-1))
            if log_sum_sq:  # log Σ exp(2z) - 2 log Σ exp(z): how peaked the distribution is
                parts["log_sum_sq"].append((2 * logits).logsumexp(-1) - 2 * logits.logsumexp(-1))
    if not parts["logps"]:  # no targets in this batch
        empty = rows.new_zeros(0, dtype=torch.float32)
        return TargetLogprobs(empty, empty if entropy else None, empty.bool() if correct else None,
                              empty if mean_logit else None, empty if log_sum_sq else None)
    cat = {k: torch.cat(v) if v else None for k, v in parts.items()}
    assert cat["logps"] is not None
    return TargetLogprobs(cat["logps"], cat["entropy"], cat["correct"], cat["mean_logit"], cat["log_sum_sq"])


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Shannon entropy (nats) of softmax(logits) over the last axis. Logits set to -inf (filtered
    out by top-k/top-p) contribute 0 instead of NaN, in value and in gradient."""
    logp = F.log_softmax(logits, dim=-1)
    finite = torch.isfinite(logp)
    safe_logp = torch.where(finite, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return -(safe_logp.exp() * safe_logp).masked_fill(~finite, 0.0).sum(dim=-1)


def entropy_from_logprobs(logp: Tensor) -> Tensor:
    """Shannon entropy (nats) of each row of finite log-probs [N, V], without gradient: on a CPU
    with pagedrl's kernels one read of the rows (`csrc/rowwise.cpp`), where torch's exp and product
    write two [N, V] copies (400 MB for a 1024-row chunk of a 49k vocabulary)."""
    if logp.device.type == "cpu" and logp.dtype == torch.float32 and logp.dim() == 2 and not logp.requires_grad:
        from pagedrl.kernels import ops

        if ops.available():
            return ops.entropy_from_logprobs(logp.contiguous())
    return -torch.linalg.vecdot(logp.exp(), logp)


def divergence_from_hidden(student_head: Callable[[Tensor], Tensor], student_rows: Tensor,
                           teacher_head: Callable[[Tensor], Tensor], teacher_rows: Tensor, beta: float,
                           temperature: float = 1.0, chunk_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """Distillation's per-token divergence [N] (`losses.generalized_jsd` over the whole vocabulary, with a
    gradient to the student) and the student's entropy [N] at `temperature` (none), from both models' hidden
    rows [N, H_s] and [N, H_t] that predict the same tokens. Each head must return logits in float32 computed
    from its operands without rounding the product (`Decoder.logits(..., float32_out=True)`, TRL's `_project`):
    bfloat16 logits would put their rounding into the divergence. Both heads run on `chunk_rows` rows at a time
    (None: `divergence_chunk_rows` of the vocabulary), and while training each chunk is recomputed in the
    backward pass rather than kept, so only one chunk's [rows, vocab] tensors (both logits and what the
    divergence's backward keeps) are alive at a time, whatever the number of tokens."""
    from torch.utils.checkpoint import checkpoint

    def widened(logits: Tensor) -> Tensor:  # bf16 logits in float32; float64 ones (a check's) kept
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def chunk(s_rows: Tensor, t_rows: Tensor) -> tuple[Tensor, Tensor]:
        student = widened(student_head(s_rows))
        with torch.no_grad():
            teacher = widened(teacher_head(t_rows))
            entropy = entropy_from_logits(student.detach() / temperature)
        return generalized_jsd(student, teacher, beta, temperature), entropy

    divergences, entropies = [], []
    if chunk_rows is None and student_rows.shape[0]:
        with torch.no_grad():
            chunk_rows = divergence_chunk_rows(teacher_head(teacher_rows[:1]).shape[-1])
    for start in range(0, student_rows.shape[0], chunk_rows or 1):
        s_rows, t_rows = student_rows[start:start + chunk_rows], teacher_rows[start:start + chunk_rows]
        if torch.is_grad_enabled() and s_rows.requires_grad:
            div, ent = checkpoint(chunk, s_rows, t_rows, use_reentrant=False)
        else:
            div, ent = chunk(s_rows, t_rows)
        divergences.append(div)
        entropies.append(ent)
    if not divergences:
        empty = student_rows.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(divergences), torch.cat(entropies)
