"""The training batch of DPO and the reward model: each pair's prompt once, both answers after it.

A preference pair is one row, `[prompt, chosen, rejected]`, padded to the longest row of the
micro-batch. The chosen tokens attend to the prompt and to themselves; the rejected tokens to the
prompt and to themselves, never to the chosen ones (`DenseAttention.segments` with the prompt as
parent of both answers), and both answers' positions continue from the prompt's end. So each
answer sees exactly the context it would see as `prompt + answer` on its own, the prompt is
computed once instead of twice, and autograd sums both answers' gradients into it.

Where DPO's `truncation_mode: keep_end` left the two answers different ends of the prompt
(`Preference.rejected_prompt_ids`), the row is `[prompt, chosen, rejected's prompt, rejected]`: the
rejected answer sees its own prompt only, from position 0, as TRL's row of it.

TRL instead runs `prompt + chosen` and `prompt + rejected` as two padded rows. One row per pair
(rather than every pair of the micro-batch in one long row) keeps attention quadratic in a pair's
length, not in the whole micro-batch's.

What each algorithm reads from the row:
- DPO: the hidden states that predict an answer token (`predict_at`, `targets`, `answer_of`),
  so the LM head runs on answer positions only;
- DPO on a mixture of experts: `token_weights`, how many of TRL's two rows hold each token (the
  prompt 2, an answer 1, padding 0). Attention is causal, so a prompt token's router logits are the
  same in both layouts, and the load-balancing loss (`train/router_loss.py`), whose counts and means
  weigh each token by its mask value, equals TRL's over its two padded rows;
- the reward model: one hidden state per answer (`score_at`), at the last token of
  `prompt + answer` that is not the pad token, as transformers' sequence classifiers read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedrl.model.attention import DenseAttention
from pagedrl.model.heads import score_index
from pagedrl.train.examples import Preference

PROMPT, CHOSEN, REJECTED, PADDING, OWN_PROMPT, OWN_REJECTED = 0, 1, 2, 3, 4, 5
# Segment → the segment it sees as its prefix: both answers see the prompt; padding sees itself only; a
# rejected answer with a prompt of its own (keep_end truncation) sees that one.
PARENT = (-1, PROMPT, PROMPT, -1, -1, OWN_PROMPT)
# Segment → the rows of TRL's layout (`prompt + chosen`, `prompt + rejected`) that hold the token (the
# prompt 1 where the rejected answer has its own).
ROWS_HOLDING = (2.0, 1.0, 1.0, 0.0, 1.0, 1.0)


@dataclass
class PairBatch:
    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    meta: DenseAttention
    num_pairs: int
    answer_lengths: torch.Tensor  # [2B] answer tokens: chosen of pairs 0..B-1, then rejected
    num_tokens: int  # tokens of prompt + chosen plus prompt + rejected (TRL's count for `num_tokens`)
    # Answer tokens (DPO): flat row of [B*T] predicting each token, the token, its answer in 0..2B-1.
    predict_at: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    answer_of: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None  # [B, T] ROWS_HOLDING of each token's segment
    # Scores (reward model): flat row of [B*T] read for each answer, chosen first.
    score_at: torch.Tensor | None = None
    margins: torch.Tensor | None = None  # [B], None when no pair has a margin
    ref_logps: torch.Tensor | None = None  # [2B] reference log-probs, when precomputed
    desirable: torch.Tensor | None = None  # [B] bool, KTO's labels (its rows: [prompt, completion, KL completion])


def collate_pairs(pairs: Sequence[Preference], pad_id: int, device: torch.device, *, answer_tokens: bool = False,
                  scores: bool = False, score_pad_id: int | None = None,
                  ref_logps: Sequence[tuple[float, float]] | None = None,
                  sliding_window: int | None = None) -> PairBatch:
    """Pairs → one padded row each. `answer_tokens` builds the per-token indices DPO needs,
    `scores` the per-answer indices the reward model needs (with `score_pad_id`, the id that
    transformers skips when it looks for the last token). `sliding_window` (Mistral) limits how
    far back a token attends, counted in positions, which restart in each sequence."""
    if not pairs:
        raise ValueError("pairs: a micro-batch needs at least one preference pair")
    B = len(pairs)
    width = max(len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_prompt_ids or []) + len(p.rejected_ids)
                for p in pairs)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    pos = torch.zeros(B, width, dtype=torch.long)
    seg = torch.full((B, width), PADDING, dtype=torch.long)
    predict: list[int] = []
    targets: list[int] = []
    answer_of: list[int] = []
    score_at = [0] * (2 * B)
    lengths = [0] * (2 * B)
    num_tokens = 0
    for b, pair in enumerate(pairs):
        p, row = len(pair.prompt_ids), b * width
        ids[b, :p] = torch.tensor(pair.prompt_ids, dtype=torch.long)
        pos[b, :p] = torch.arange(p)
        seg[b, :p] = PROMPT
        start = p
        for k, (answer, segment) in enumerate(((pair.chosen_ids, CHOSEN), (pair.rejected_ids, REJECTED))):
            n, a = len(answer), k * B + b
            context, at = pair.prompt_ids, 0  # the answer's prompt and where it starts in the row
            if k == 1 and pair.rejected_prompt_ids is not None:
                context, at, segment = pair.rejected_prompt_ids, start, OWN_REJECTED
                start += len(context)
                ids[b, at:start] = torch.tensor(context, dtype=torch.long)
                pos[b, at:start] = torch.arange(len(context))
                seg[b, at:start] = OWN_PROMPT
            c = len(context)
            ids[b, start:start + n] = torch.tensor(answer, dtype=torch.long)
            pos[b, start:start + n] = torch.arange(c, c + n)
            seg[b, start:start + n] = segment
            lengths[a] = n
            num_tokens += c + n
            if answer_tokens:
                # Answer token j is predicted by the row before it in its own sequence: the prompt's
                # last token for j = 0 (none if the prompt is empty: like TRL, that token is not scored).
                for j in range(0 if c else 1, n):
                    predict.append(row + (at + c - 1 if j == 0 else start + j - 1))
                    targets.append(answer[j])
                    answer_of.append(a)
            if scores:
                i = score_index(context + answer, score_pad_id)
                score_at[a] = row + (at + i if i < c else start + i - c)
            start += n
    parent = torch.tensor(PARENT, dtype=torch.long, device=device)
    pos = pos.to(device)
    meta = DenseAttention.segments(seg.to(device), parent)
    if sliding_window is not None:
        meta.mask &= (pos[:, :, None] - pos[:, None, :]) < sliding_window
    batch = PairBatch(
        input_ids=ids.to(device), positions=pos, meta=meta,
        num_pairs=B, answer_lengths=torch.tensor(lengths, dtype=torch.long, device=device), num_tokens=num_tokens)
    if answer_tokens:
        batch.predict_at = torch.tensor(predict, dtype=torch.long, device=device)
        batch.targets = torch.tensor(targets, dtype=torch.long, device=device)
        batch.answer_of = torch.tensor(answer_of, dtype=torch.long, device=device)
        weights = torch.tensor(ROWS_HOLDING)[seg]
        for b, pair in enumerate(pairs):
            if pair.rejected_prompt_ids is not None:  # the chosen answer's prompt is in its TRL row alone
                weights[b, :len(pair.prompt_ids)] = 1.0
        batch.token_weights = weights.to(device)
    if scores:
        batch.score_at = torch.tensor(score_at, dtype=torch.long, device=device)
        if any(p.margin is not None for p in pairs):
            batch.margins = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32, device=device)
    if ref_logps is not None:
        chosen, rejected = zip(*ref_logps, strict=True)
        batch.ref_logps = torch.tensor(chosen + rejected, dtype=torch.float32, device=device)
    return batch
