"""GRPO's training batch: each group's prompt once, its completions packed after it.

A micro-batch is one row: [prompt A, A's completions..., prompt B, B's completions...]. Every
completion attends to its own prompt's keys and values and to itself, never to a sibling
(`DenseAttention.segments` with the prompt as parent segment), and its positions continue from
the prompt's end, so each completion sees exactly what it saw when it was sampled. The prompt is
computed once instead of G times and autograd sums the G completions' gradients into it. Nothing
is padded, and the LM head runs only on the rows that predict a completion token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrl.model.attention import DenseAttention
from pagedrl.train.rl.rollout import Group


@dataclass
class Unit:
    """A group, or part of one, that goes into a micro-batch: the prompt and some completions."""

    group: Group
    indices: list[int]


@dataclass
class GRPOBatch:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    meta: DenseAttention
    predict_at: torch.Tensor  # [N] row of the hidden state predicting each completion token
    targets: torch.Tensor  # [N] the completion tokens
    seq_of: torch.Tensor  # [N] which completion (0..S-1) each token belongs to
    col_of: torch.Tensor  # [N] its index within that completion
    mask: torch.Tensor  # [S, L] bool: real (and not masked-out) completion tokens
    advantages: torch.Tensor  # [S]
    sampling_logps: torch.Tensor  # [S, L] the engine's log-probs, 0 where masked
    old_logps: torch.Tensor | None = None  # [S, L] for μ > 1: log-probs before the first update
    ref_logps: torch.Tensor | None = None  # [S, L] the frozen reference's, once per rollout (beta > 0)
    num_prompt_tokens: int = 0

    @property
    def num_sequences(self) -> int:
        return self.mask.shape[0]

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per-token values → [S, L], zero where there is no token."""
        out = values.new_zeros(self.mask.shape)
        return out.index_put((self.seq_of, self.col_of), values)


def split_units(groups: list[Group], num_micro_batches: int) -> list[list[Unit]]:
    """Cut the step's completions into micro-batches of (nearly) equal count, keeping each group's
    completions together where the cut allows (a group cut in two carries its prompt in both)."""
    flat = [(g, i) for g in groups for i in range(len(g.completion_ids))]
    size, extra = divmod(len(flat), num_micro_batches)
    out: list[list[Unit]] = []
    start = 0
    for k in range(num_micro_batches):
        chunk = flat[start:start + size + (1 if k < extra else 0)]
        start += len(chunk)
        units: list[Unit] = []
        for g, i in chunk:
            if units and units[-1].group is g:
                units[-1].indices.append(i)
            else:
                units.append(Unit(g, [i]))
        out.append(units)
    return out


def collate_grpo(units: list[Unit], device: torch.device, mask_truncated: bool = False) -> GRPOBatch:
    ids: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    parent: list[int] = []
    predict, targets, seq_of, col_of = [], [], [], []
    lengths, advantages, sampling, keep = [], [], [], []
    num_prompt = 0
    for unit in units:
        g = unit.group
        prompt_seg = len(parent)
        parent.append(-1)
        base = len(ids)
        p = len(g.prompt_ids)
        ids += g.prompt_ids
        pos += range(p)
        seg += [prompt_seg] * p
        num_prompt += p
        for i in unit.indices:
            comp = g.completion_ids[i]
            s = len(lengths)
            my_seg = len(parent)
            parent.append(prompt_seg)
            start = len(ids)
            ids += comp
            pos += range(p, p + len(comp))
            seg += [my_seg] * len(comp)
            # Token j is predicted by the row before it: the prompt's last token for j = 0.
            rows = [base + p - 1] + [start + j for j in range(len(comp) - 1)]
            predict += rows
            targets += comp
            seq_of += [s] * len(comp)
            col_of += range(len(comp))
            lengths.append(len(comp))
            advantages.append(float(g.advantages[i]))
            sampling.append(g.sampling_logps[i])
            keep.append(not (mask_truncated and g.truncated[i]))
    S, L = len(lengths), max(lengths) if lengths else 0
    mask = torch.zeros(S, L, dtype=torch.bool)
    sampled = torch.zeros(S, L, dtype=torch.float32)
    for s, (n, lp, k) in enumerate(zip(lengths, sampling, keep, strict=True)):
        mask[s, :n] = k
        sampled[s, :n] = torch.tensor(lp, dtype=torch.float32)
    seg_t = torch.tensor([seg], device=device)
    meta = DenseAttention.segments(seg_t, torch.tensor(parent, device=device))
    return GRPOBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        positions=torch.tensor([pos], dtype=torch.long, device=device),
        meta=meta,
        predict_at=torch.tensor(predict, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        seq_of=torch.tensor(seq_of, dtype=torch.long, device=device),
        col_of=torch.tensor(col_of, dtype=torch.long, device=device),
        mask=mask.to(device),
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device),
        sampling_logps=sampled.to(device),
        num_prompt_tokens=num_prompt,
    )
