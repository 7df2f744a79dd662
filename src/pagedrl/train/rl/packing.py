"""An online algorithm's training batch: each prompt once, its completions packed after it.

A micro-batch is one row: [prompt A, A's completions..., prompt B, B's completions...]. Every
completion attends to its own prompt's keys and values and to itself, never to a sibling
(`DenseAttention.segments` with the prompt as parent segment), and its positions continue from
the prompt's end, so each completion sees exactly what it saw when it was sampled. The prompt is
computed once instead of G times and autograd sums the G completions' gradients into it. Nothing
is padded, and a head runs only on the rows that need it: the LM head and a value head on the
rows that predict a completion token, a reward head on each completion's last token.

GRPO and PPO share the layout; each fills the per-sequence or per-token tensors its loss needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedrl.model.attention import DenseAttention
from pagedrl.train.rl.rollout import Rollout


@dataclass
class Unit:
    """A prompt and some of its completions (flat rollout indices) that go into a micro-batch."""

    prompt: int
    completions: list[int]


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    meta: DenseAttention
    predict_at: torch.Tensor  # [N] row of the hidden state predicting each completion token
    targets: torch.Tensor  # [N] the completion tokens
    seq_of: torch.Tensor  # [N] which completion (0..S-1) each token belongs to
    col_of: torch.Tensor  # [N] its index within that completion
    last_at: torch.Tensor  # [S] row of each completion's last token (where a sequence is scored)
    completion_index: torch.Tensor  # [S] each completion's flat index in the rollout
    lengths: torch.Tensor  # [S] completion lengths
    mask: torch.Tensor  # [S, L] bool: real (and not masked-out) completion tokens
    sampling_logps: torch.Tensor  # [S, L] the engine's log-probs, 0 where there is no token
    num_prompt_tokens: int = 0
    # [1, T] how many of TRL's padded rows (prompt + one completion each) hold each token: a prompt
    # its completions here, a completion token 1 (0 when masked out); the router loss's token weights.
    token_weights: torch.Tensor | None = None
    # Filled by the algorithm, once per rollout.
    advantages: torch.Tensor | None = None  # [S] (GRPO) or [S, L] (PPO)
    old_logps: torch.Tensor | None = None  # [S, L] the policy's before the first update of the rollout
    ref_logps: torch.Tensor | None = None  # [S, L] the frozen reference's
    old_values: torch.Tensor | None = None  # [S, L] the critic's (PPO)
    returns: torch.Tensor | None = None  # [S, L] the value targets (PPO)

    @property
    def num_sequences(self) -> int:
        return self.mask.shape[0]

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per-token values → [S, L], zero where there is no token."""
        out = values.new_zeros(self.mask.shape)
        return out.index_put((self.seq_of, self.col_of), values)

    def to_flat(self, values: torch.Tensor) -> torch.Tensor:
        """[S, L] → [N], the inverse of `to_padded`."""
        return values[self.seq_of, self.col_of]


def split_units(rollout: Rollout, num_micro_batches: int, order: Sequence[int] | None = None) -> list[list[Unit]]:
    """Cut the rollout's completions (all, or those of `order`, in that order) into micro-batches of
    (nearly) equal count, keeping each group's completions together where the cut allows (a group
    cut in two carries its prompt in both)."""
    G = rollout.num_generations
    order = list(range(len(rollout))) if order is None else list(order)
    size, extra = divmod(len(order), num_micro_batches)
    out: list[list[Unit]] = []
    start = 0
    for k in range(num_micro_batches):
        end = start + size + (1 if k < extra else 0)
        units: list[Unit] = []
        for i in order[start:end]:
            if units and units[-1].prompt == i // G:
                units[-1].completions.append(i)
            else:
                units.append(Unit(i // G, [i]))
        out.append(units)
        start = end
    return out


def pack(rollout: Rollout, units: list[Unit], device: torch.device, mask_truncated: bool = False) -> PackedBatch:
    """One packed micro-batch of `units`; `mask_truncated` leaves completions cut by max_tokens out of the mask."""
    ids: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    parent: list[int] = []
    predict, targets, seq_of, col_of, last_at, index = [], [], [], [], [], []
    lengths, sampling, keep = [], [], []
    num_prompt = 0
    weights: list[float] = []
    for unit in units:
        prompt_ids = rollout.prompts[unit.prompt].prompt_ids
        prompt_seg = len(parent)
        parent.append(-1)
        base = len(ids)
        p = len(prompt_ids)
        ids += prompt_ids
        pos += range(p)
        seg += [prompt_seg] * p
        weights += [float(len(unit.completions))] * p
        num_prompt += p
        for i in unit.completions:
            comp = rollout.completion_ids[i]
            s = len(lengths)
            parent.append(prompt_seg)
            my_seg = len(parent) - 1
            start = len(ids)
            ids += comp
            pos += range(p, p + len(comp))
            seg += [my_seg] * len(comp)
            # Token j is predicted by the row before it: the prompt's last token for j = 0.
            predict += [base + p - 1] + [start + j for j in range(len(comp) - 1)]
            targets += comp
            seq_of += [s] * len(comp)
            col_of += range(len(comp))
            last_at.append(start + len(comp) - 1 if comp else base + p - 1)
            index.append(i)
            lengths.append(len(comp))
            sampling.append(rollout.sampling_logps[i])
            keep.append(not (mask_truncated and bool(rollout.truncated[i])))
            weights += [float(keep[-1])] * len(comp)
    S, L = len(lengths), max(lengths) if lengths else 0
    mask = torch.zeros(S, L, dtype=torch.bool)
    sampled = torch.zeros(S, L, dtype=torch.float32)
    for s, (n, lp, k) in enumerate(zip(lengths, sampling, keep, strict=True)):
        mask[s, :n] = k
        sampled[s, :n] = torch.tensor(lp, dtype=torch.float32)
    seg_t = torch.tensor([seg], device=device)

    def as_long(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return PackedBatch(
        input_ids=as_long([ids]), positions=as_long([pos]),
        meta=DenseAttention.segments(seg_t, torch.tensor(parent, device=device)),
        predict_at=as_long(predict), targets=as_long(targets), seq_of=as_long(seq_of), col_of=as_long(col_of),
        last_at=as_long(last_at), completion_index=as_long(index), lengths=as_long(lengths),
        mask=mask.to(device), sampling_logps=sampled.to(device), num_prompt_tokens=num_prompt,
        token_weights=torch.tensor([weights], dtype=torch.float32, device=device),
    )
