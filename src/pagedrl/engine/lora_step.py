"""How one step's tokens meet their LoRA adapters: made once per step, read by every `SlotLinear`.

No token's update may touch another slot's numbers, not even times zero (0 * NaN is NaN: one
adapter with a NaN in its weights would empty every answer of the step). So each token goes through
its own slot's A and B only, in one of two shapes:

- a run: at least `RUN_MIN_TOKENS` consecutive tokens of one adapter (a prompt's prefill chunk, or
  the decode tokens of neighbouring sequences that share an adapter) is updated in place through its
  slot's A and B, two plain matmuls on slices: no copy at all;
- the rest (decode tokens, short prompts) is gathered into a batch of equal-width entries, each one
  slot's, then two batched matmuls and each token's own row added back.

When the rest's groups are about even (decode), each slot of their range gets one entry as wide as
the largest group, so the stacked weights serve as they are; when one group is much longer, entries
are the mean group wide, a long group takes several, a slot without tokens none, and each entry's
weights are gathered: either way the batch holds at most about twice the tokens it serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BASE = -1  # the slot of tokens without an adapter
RUN_MIN_TOKENS = 32  # consecutive tokens of one adapter updated in place, not gathered


@dataclass
class Grouped:
    """A step's tokens gathered by slot into a batch of `width`-row entries (padding rows are junk,
    never read back). Slots `lo` to `hi` (exclusive) hold their adapters."""

    lo: int
    hi: int
    width: int
    gather: torch.Tensor  # [entries * width]: the step's token each row of the batch holds (padding: token 0)
    back: torch.Tensor  # [tokens]: each one's row of the [entries * width, out] update, in step order
    entry_slot: torch.Tensor | None  # each entry's slot (from lo); None: one entry per slot of the range
    tokens: torch.Tensor | None  # their rows of the step; None when they are all of the step's tokens

    @classmethod
    def of(cls, tokens: torch.Tensor, slot: torch.Tensor, num_step_tokens: int, device: torch.device) -> Grouped:
        """The batch of `tokens` (rows of the step, ascending) whose adapters sit in `slot`."""
        lo, hi = int(slot.min()), int(slot.max()) + 1
        n, num = hi - lo, len(tokens)
        counts = torch.bincount(slot - lo, minlength=n)
        width = int(counts.max())
        if n * width <= 2 * num:
            entries, entry_slot = torch.ones(n, dtype=torch.long), None
        else:
            width = -(-num // int((counts > 0).sum()))
            entries = -(-counts // width)
            entry_slot = torch.repeat_interleave(torch.arange(n), entries).to(device)
        order = torch.argsort(slot, stable=True)  # grouped by slot, in step order within a slot
        grouped_slot = slot[order] - lo
        within = torch.arange(num) - (torch.cumsum(counts, 0) - counts)[grouped_slot]
        first_entry = torch.cumsum(entries, 0) - entries
        place = (first_entry[grouped_slot] + within // width) * width + within % width
        gather = torch.zeros(int(entries.sum()) * width, dtype=torch.long)
        gather[place] = tokens[order]
        back = torch.empty_like(place)
        back[order] = place
        every = num == num_step_tokens
        return cls(lo, hi, width, gather.to(device), back.to(device), entry_slot, None if every else tokens.to(device))


@dataclass
class StepSlots:
    """The running step's plan: its runs, its grouped rest, and the range of slots it uses at all."""

    lo: int
    hi: int
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first token, end, slot)
    grouped: Grouped | None = None
    token_slot: torch.Tensor | None = None  # each token's slot (BASE: none), on the host: experts' rows read it

    @classmethod
    def plan(cls, token_slot: torch.Tensor, device: torch.device) -> StepSlots:
        """From each token's slot (BASE for the base model's; at least one token has an adapter)."""
        num = len(token_slot)
        adapted = token_slot != BASE
        used = token_slot[adapted]
        step = cls(int(used.min()), int(used.max()) + 1, token_slot=token_slot)
        change = torch.ones(num, dtype=torch.bool)
        change[1:] = token_slot[1:] != token_slot[:-1]
        starts = change.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([num]))
        slots = token_slot[starts]
        long = (lengths >= RUN_MIN_TOKENS) & (slots != BASE)
        step.runs = list(zip(starts[long].tolist(), (starts + lengths)[long].tolist(), slots[long].tolist(),
                             strict=True))
        rest = adapted & ~torch.repeat_interleave(long, lengths)
        if bool(rest.any()):
            tokens = rest.nonzero().flatten()
            step.grouped = Grouped.of(tokens, token_slot[tokens], num, device)
        return step
