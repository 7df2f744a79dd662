"""Penalties, temperature and truncation of a step's logits: the one path both the sampler and a
trainer's recompute of its tokens' log-probs (`processed_logprobs`) go through, so the two agree to
float rounding (the logprob contract). The order and meanings are vLLM's: penalties (repetition on
prompt + output, presence and frequency on output) -> banned ids -> structured-output mask ->
temperature -> top-k -> top-p -> min-p; the last five live in `process_logits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
import torch.nn.functional as F
from torch import Tensor

NEG_INF = float("-inf")
PerRow = float | int | Tensor


# ----------------------------------------------------------------------------- penalties


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> Tensor:
    """How often each vocabulary id occurs in each row's token list: float32 [S, V]."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long)
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32)
    if flat.numel():
        if int(flat.min()) < 0 or int(flat.max()) >= vocab_size:
            raise ValueError(f"token_ids must lie in [0, {vocab_size}), got ids from "
                             f"{int(flat.min())} to {int(flat.max())}")
        rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
        counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts.to(device)


def apply_penalties(logits: Tensor, prompt_mask: Tensor, output_counts: Tensor, presence: Tensor,
                    frequency: Tensor, repetition: Tensor) -> Tensor:
    """vLLM's penalties, out of place. A token seen in prompt or output has its logit divided by
    `repetition` when positive and multiplied by it otherwise; then the output count times
    `frequency`, and `presence` once if it occurred in the output, are subtracted.

    The result stays finite where the logit was: a penalty too small for the logits' dtype (1e-96 is 0
    in float32) would otherwise divide by zero, and inf or NaN logits sample garbage."""
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    tiny = torch.finfo(logits.dtype).tiny
    rep = torch.where(seen, repetition[:, None].clamp(min=tiny), torch.ones_like(logits))
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    big = torch.finfo(logits.dtype).max
    scaled = torch.where(torch.isfinite(logits), scaled.clamp(-big, big), logits)
    return scaled - frequency[:, None] * output_counts - presence[:, None] * output_mask.to(logits.dtype)


# ------------------------------------------------- temperature and truncation (shared path)


def _per_row(name: str, value: PerRow, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    tensor = torch.as_tensor(value, dtype=dtype, device=device)
    if tensor.dim() == 0:
        tensor = tensor.expand(rows)
    if tensor.shape != (rows,):
        raise ValueError(f"{name} must be a scalar or have shape ({rows},), got {tuple(tensor.shape)}")
    return tensor


def _truncation_mask(x: Tensor, k: Tensor, p: Tensor, min_p: Tensor) -> Tensor | None:
    """True where a token falls outside top-k, top-p or min-p of the (temperature-scaled) logits
    `x`; k == V, p == 1 and min_p == 0 are no-ops. None when nothing is truncated."""
    vocab = x.shape[-1]
    mask = None
    use_k, use_p = bool((k < vocab).any()), bool((p < 1.0).any())
    if use_k or use_p:
        ordered = x.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (k - 1)[:, None])
        mask = x < kth
        if use_p:
            ordered = ordered.masked_fill(ordered < kth, NEG_INF)
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)
            # First sorted position where the mass reaches p: the least likely token kept.
            cut = (mass < p[:, None]).sum(dim=-1).clamp(max=vocab - 1)
            cut = torch.where(p >= 1.0, vocab - 1, cut)  # rounding must not truncate p == 1 rows
            mask |= x < ordered.gather(1, cut[:, None])
    if bool((min_p > 0.0).any()):
        # p_i >= min_p * p_max is a ratio of probabilities, so it holds before or after the
        # renormalisation top-k/top-p imply (the top token always survives them).
        ratio = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        below = ratio < min_p[:, None]
        mask = below if mask is None else mask | below
    return mask


def process_logits(logits: Tensor, temperature: PerRow = 1.0, top_k: PerRow = 0, top_p: PerRow = 1.0,
                   min_p: PerRow = 0.0, allowed: Tensor | None = None) -> Tensor:
    """Logits of the distribution a token is actually drawn from, [N, V]: -inf where `allowed`
    ([N, V] bool, a structured-output mask; None allows all) is False, divided by the row's
    temperature, and -inf outside its top-k / top-p / min-p set. Each setting is a scalar or a
    per-row tensor [N]. Rows with temperature 0 (greedy) come back unscaled and untruncated (but
    masked). Differentiable w.r.t. `logits` (the truncation set itself is not)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    if allowed is not None:
        if allowed.shape != logits.shape or allowed.dtype != torch.bool:
            raise ValueError(f"allowed must be a bool tensor of shape {tuple(logits.shape)}, "
                             f"got {allowed.dtype} {tuple(allowed.shape)}")
        logits = logits.masked_fill(~allowed, NEG_INF)
    temperature = _per_row("temperature", temperature, rows, logits.dtype, device)
    top_k = _per_row("top_k", top_k, rows, torch.long, device)
    top_p = _per_row("top_p", top_p, rows, logits.dtype, device)
    min_p = _per_row("min_p", min_p, rows, logits.dtype, device)
    greedy = temperature == 0.0
    divisor = torch.where(greedy, 1.0, temperature)
    # x / 1 is x: rows at temperature 1 (and greedy ones) skip a pass over the vocabulary.
    x = logits if bool((divisor == 1.0).all()) else logits / divisor[:, None]
    k = torch.where((top_k <= 0) | (top_k >= vocab) | greedy, vocab, top_k)
    p = torch.where(greedy, 1.0, top_p)
    m = torch.where(greedy, 0.0, min_p)
    with torch.no_grad():
        mask = _truncation_mask(x.detach(), k, p, m)
    return x if mask is None else x.masked_fill(mask, NEG_INF)


def processed_logprobs(logits: Tensor, token_ids: Tensor, temperature: PerRow = 1.0, top_k: PerRow = 0,
                       top_p: PerRow = 1.0, min_p: PerRow = 0.0, allowed: Tensor | None = None) -> Tensor:
    """Log-prob of `token_ids` [N] under the masked, truncated, renormalised distribution of
    `logits` [N, V] (same settings, same code as the sampler): what a trainer recomputes for its
    ratio. A token outside the kept set gets -inf. Pass penalised logits to match a penalised row,
    and the structured-output mask of a constrained row as `allowed` ([N, V] bool)."""
    if token_ids.shape != logits.shape[:1]:
        raise ValueError(f"token_ids must have shape ({logits.shape[0]},), got {tuple(token_ids.shape)}")
    logp = processed_log_softmax(logits, temperature, top_k, top_p, min_p, allowed)
    return logp.gather(1, token_ids.long()[:, None]).squeeze(1)


def processed_log_softmax(logits: Tensor, temperature: PerRow = 1.0, top_k: PerRow = 0, top_p: PerRow = 1.0,
                          min_p: PerRow = 0.0, allowed: Tensor | None = None) -> Tensor:
    """The whole [N, V] log-distribution `processed_logprobs` reads its targets from (a caller that
    also wants the distribution's entropy reads it from the same tensor)."""
    return F.log_softmax(process_logits(logits, temperature, top_k, top_p, min_p, allowed), dim=-1)
