"""Turn one step's logits into tokens, and keep the log-prob contract with the trainer.

Processing follows vLLM: the request's allowed ids and logit bias (`engine/token_choices.py`) ->
penalties (repetition on prompt + output, presence and frequency on output) -> banned ids (bad words,
min_tokens) -> structured-output mask -> temperature -> top-k -> top-p -> min-p. The
last five live in `process_logits` (`engine/logits_processing.py`), which both the sampler and `processed_logprobs` (what a trainer
calls to recompute the log-prob of given tokens) go through, so the two agree to float rounding.

Choices worth knowing:

- Ties are kept. Top-k keeps every token whose logit equals the k-th largest; top-p keeps the
  smallest set of most likely tokens whose mass reaches `top_p`, plus every token tied with the
  least likely member of that set. The kept set therefore never depends on sort order.
- Greedy rows (temperature 0) take the argmax of the penalised logits, ignore top-k/top-p/min-p,
  and draw no randomness. Their processed log-prob is the log-softmax of the penalised logits
  (temperature 1) at the argmax: the distribution the argmax was read from. A CPU step of greedy
  rows that change nothing and want no alternatives takes `greedy_pick` (the argmax and its
  log-prob in two reads of the logits, no [S, V] log-softmax written; the same tokens, log-probs
  within a float32 rounding of it).
- Random rows use the exponential race argmax(p / E), E = -log U ~ Exp(1) with U drawn from the
  row's own generator (or one shared generator for rows without a seed), so a seeded request
  draws the same tokens whatever else is in the batch and whichever row it sits in.
- A structured-output row (a grammar's token bitmask) has every refused token set to -inf before
  temperature and truncation, so the mask is part of the processed distribution: its processed
  log-probs are renormalised over the allowed tokens only, refused tokens have processed log-prob
  -inf and are never drawn, and top-k/top-p/min-p act on the allowed set. Raw log-probs stay the
  unmasked model's. The row's noise is drawn over the whole vocabulary as for any row, so a seeded
  constrained request stays batch-invariant.
- A row whose settings refuse every token (a grammar, allowed_token_ids, bad words and min_tokens'
  bans together) is drawn from its raw logits and returned with processed log-prob -inf: the engine
  ends that request with finish_reason "error", the rest of the batch goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrl.engine.grammar import bitmask_bias
from pagedrl.engine.logits_processing import NEG_INF, apply_penalties, process_logits, token_counts
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.engine.token_choices import choose_tokens
from pagedrl.kernels import ops

# ----------------------------------------------------------------------------------- sampler


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator of a seeded request (any Python int is a valid seed)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


@dataclass
class SamplingRow:
    """What the sampler needs about one sequence this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    banned_token_ids: Sequence[int] = ()  # `params.min_tokens_banned_ids(...)`, bad words' last tokens
    token_bitmask: Tensor | None = None  # int32 [ceil(V / 32)]: a grammar's allowed tokens (grammar.py)


@dataclass
class SamplerOutput:
    """Per row: the token, its processed and raw log-probs, and the requested alternatives
    (`{token_id: logprob}` in order best first, from the distribution `logprobs_mode` names; in
    processed mode truncated tokens show -inf; a row with `logprob_token_ids` gets those ids, in its
    order), or None when no log-probs were asked for."""

    token_ids: Tensor  # [S] long
    processed_logprobs: Tensor  # [S] under the distribution the token was drawn from
    raw_logprobs: Tensor  # [S] log_softmax of the unmodified logits
    top_logprobs: list[dict[int, float] | None]
    # the sampled token's rank (1 = most likely) in the distribution its alternatives come from, for
    # rows that asked for log-probs (vLLM reports it even outside the alternatives); None for the rest
    sampled_ranks: list[int | None] | None = None
    # for rows with `logprob_token_ids`, each named id's rank in that distribution; None for the rest
    named_ranks: list[list[int] | None] | None = None

    def ranks_of(self, row: int) -> tuple[int | None, list[int] | None]:
        """Row `row`'s sampled-token rank and its named ids' ranks (`logprob_entry`'s last arguments)."""
        return (self.sampled_ranks[row] if self.sampled_ranks else None,
                self.named_ranks[row] if self.named_ranks else None)


class Sampler:
    """Samples one token per row. `generator` serves rows without their own (None: torch's global RNG)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._raw: Tensor | None = None  # see `_log_softmax`
        self._noise: Tensor | None = None  # see `_choose`

    def reseed(self, seed: int) -> None:
        """Restart the stream of rows without a generator of their own."""
        if self.generator is None:
            raise ValueError("this sampler draws from torch's global generator; give it its own to reseed it")
        self.generator.manual_seed(seed)

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got shape {tuple(logits.shape)}")
        logits = logits.float()
        vocab, device = logits.shape[1], logits.device
        # One pass over the rows: whether any changes its logits, which rows draw (from their own
        # generator or the shared one), whether any wants alternatives.
        unchanged, seeded, shared, wants_top, passed = True, [], [], False, None
        for i, row in enumerate(rows):
            p = row.params
            if unchanged and (p is not passed or row.banned_token_ids or row.token_bitmask is not None):
                # (rows of one request, or of one rollout, share their params: checked once)
                unchanged = _leaves_logits_unchanged(row, vocab)
                passed = p
            if p.temperature != 0.0:
                (shared if row.generator is None else seeded).append(i)
            if p.num_logprobs is not None:
                wants_top = True
        if unchanged and not (seeded or shared or wants_top):
            picked = _greedy_pick(logits)
            if picked is not None:
                return SamplerOutput(token_ids=picked[0], processed_logprobs=picked[1],
                                     raw_logprobs=picked[1].clone(), top_logprobs=[None] * len(rows))
        raw = self._log_softmax(logits)
        dead: Tensor | None = None  # rows whose every token the choices, bans and grammar refuse
        if unchanged:
            # Processing would return these very logits (dividing by 1.0 is exact), so the drawn-from
            # distribution is the raw one: skip two [S, V] passes that would recompute it bit for bit.
            logp = raw
        else:
            params = [row.params for row in rows]
            x = self._constrain(self._ban(self._penalise(choose_tokens(logits, params), rows), rows), rows)
            if any(row.banned_token_ids or row.token_bitmask is not None or row.params.allowed_token_ids is not None
                   for row in rows):  # only these can refuse every token
                dead = torch.isneginf(x).all(dim=-1)
                dead = dead if bool(dead.any()) else None
            if dead is not None:  # drawn from the raw logits, so the batch goes on; marked -inf below
                x = torch.where(dead[:, None], logits, x)
            x = process_logits(
                x,
                torch.tensor([p.temperature for p in params], device=device),
                torch.tensor([p.top_k for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            )
            logp = F.log_softmax(x, dim=-1)
        tokens = self._choose(logp, rows, seeded, shared)
        processed = logp.gather(1, tokens[:, None]).squeeze(1)
        if dead is not None:
            processed = processed.masked_fill(dead, NEG_INF)
        top, ranks, named = _top_logprobs(raw, logp, tokens, [row.params for row in rows], vocab) if wants_top \
            else ([None] * len(rows), None, None)
        return SamplerOutput(
            token_ids=tokens,
            processed_logprobs=processed,
            raw_logprobs=raw.gather(1, tokens[:, None]).squeeze(1),
            top_logprobs=top,
            sampled_ranks=ranks,
            named_ranks=named,
        )

    def _log_softmax(self, logits: Tensor) -> Tensor:
        """`log_softmax(logits)`, on a CPU into a buffer kept across calls (see `_kept`). Nothing
        returned by `__call__` aliases the buffer."""
        if logits.device.type != "cpu" or logits.requires_grad:
            return F.log_softmax(logits, dim=-1)
        return torch.log_softmax(logits, dim=-1, out=self._kept("_raw", logits))

    def _kept(self, name: str, like: Tensor) -> Tensor:
        """A buffer shaped like `like`, kept on the sampler under `name` across calls: a fresh [S, V]
        tensor is mapped anew by the C allocator on every step, and on a CPU its page faults cost
        three times the log-softmax itself."""
        buf = getattr(self, name)
        if (buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype or buf.device != like.device
                or buf.is_inference() != torch.is_inference_mode_enabled()):
            setattr(self, name, None)
            buf = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
            setattr(self, name, buf)
        return buf[:like.numel()].view(like.shape)

    def _penalise(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        picked = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if not picked:
            return logits
        vocab, device = logits.shape[1], logits.device
        params = [rows[i].params for i in picked]
        prompt = token_counts([rows[i].prompt_token_ids for i in picked], vocab, device)
        output = token_counts([rows[i].output_token_ids for i in picked], vocab, device)
        index = torch.tensor(picked, device=device)
        penalised = apply_penalties(
            logits[index], prompt > 0, output,
            torch.tensor([p.presence_penalty for p in params], device=device),
            torch.tensor([p.frequency_penalty for p in params], device=device),
            torch.tensor([p.repetition_penalty for p in params], device=device),
        )
        return logits.index_copy(0, index, penalised)

    @staticmethod
    def _ban(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        pairs = [(i, t) for i, row in enumerate(rows) for t in row.banned_token_ids]
        if not pairs:
            return logits
        vocab = logits.shape[1]
        if any(not 0 <= t < vocab for _, t in pairs):
            raise ValueError(f"banned_token_ids must lie in [0, {vocab}), got {sorted({t for _, t in pairs})}")
        row_index, token_index = torch.tensor(pairs, device=logits.device).T
        return logits.index_put((row_index, token_index), torch.tensor(NEG_INF, device=logits.device))

    @staticmethod
    def _constrain(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """-inf for every token a row's grammar refuses (rows without a bitmask are left alone)."""
        picked = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
        if not picked:
            return logits
        vocab, device = logits.shape[1], logits.device
        bits = torch.stack([rows[i].token_bitmask for i in picked]).to(device, non_blocking=True)
        bias = bitmask_bias(bits, vocab, logits.dtype)
        if len(picked) == len(rows):
            masked = logits + bias
        else:
            masked = logits.index_add(0, torch.tensor(picked, device=device), bias)
        return masked

    def _choose(self, logp: Tensor, rows: Sequence[SamplingRow], seeded: list[int], shared: list[int]) -> Tensor:
        """Argmax for greedy rows; exponential race with the row's own noise for the rest (`seeded`
        rows draw from their own generator, `shared` ones from the sampler's)."""
        device = logp.device
        if not seeded and not shared:
            return first_argmax(logp)
        # Noise only for the drawn rows (seeded first, then shared), each row from its own stream.
        drawn = seeded + shared
        every = drawn == list(range(len(rows)))
        picked = logp if every else logp.index_select(0, torch.tensor(drawn, device=device))
        noise = self._kept("_noise", picked) if device.type == "cpu" else torch.empty_like(picked)
        for j, i in enumerate(seeded):
            noise[j].uniform_(generator=rows[i].generator)
        if shared:
            noise[len(seeded):].uniform_(generator=self.generator)
        # E = -log U is Exp(1) for U uniform on [0, 1), and argmax(p / E) = argmax(log p - log E):
        # the race as -log(-log U) added to log p, in place (a CPU's exponential_ costs four times
        # uniform_ and two logs). U = 0 makes E infinite: that token cannot win.
        race = noise.log_().neg_().log_().neg_().add_(picked)
        winners = first_argmax(race)
        if every:
            return winners
        return first_argmax(logp).index_copy(0, torch.tensor(drawn, device=device), winners)


def _greedy_pick(logits: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row's argmax (the first of equal maxima) and its log-softmax, from the CPU kernel; None
    where it does not serve (not a CPU, not built, autograd on) or a row is not finite (the full path
    then gives torch's answer for NaN and infinities)."""
    if logits.device.type != "cpu" or logits.requires_grad or not ops.available():
        return None
    tokens, logp = ops.greedy_pick(logits.contiguous())
    return (tokens, logp) if bool(torch.isfinite(logp).all()) else None


def first_argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)` (the first of equal maxima) through `max`, which a CPU runs 2.4x as fast
    (0.87 vs 2.1 ms over [64, 49152] float32)."""
    return x.max(dim=-1).indices


def _leaves_logits_unchanged(row: SamplingRow, vocab: int) -> bool:
    """Whether token choices, penalties, bans, temperature and truncation all leave this row's logits
    as they are (no bias, allowed set, penalty or ban; temperature 0, or 1 with no top-k, top-p or
    min-p cut)."""
    p = row.params
    if row.banned_token_ids or row.token_bitmask is not None or p.has_penalties or p.chooses_tokens:
        return False
    if p.temperature == 0.0:
        return True
    return p.temperature == 1.0 and (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0


def _top_logprobs(raw: Tensor, processed: Tensor, tokens: Tensor, params: Sequence[SamplingParams], vocab: int
                  ) -> tuple[list[dict[int, float] | None], list[int | None], list[list[int] | None] | None]:
    """The `logprobs` best alternatives of each row that asked, from raw or processed log-probs, and
    the sampled token's rank there (1 + the tokens strictly more likely); a row with `logprob_token_ids`
    gets those ids' log-probs instead, in its order, each with its rank by the same rule."""
    named_ids = [p.logprob_token_ids for p in params]
    wanted = [0 if ids is not None else min(p.logprobs, vocab) if p.logprobs else 0
              for p, ids in zip(params, named_ids, strict=True)]
    result: list[dict[int, float] | None] = [{} if p.logprobs == 0 else None for p in params]
    use_processed = torch.tensor([p.logprobs_mode == "processed_logprobs" for p in params], device=raw.device)
    source = torch.where(use_processed[:, None], processed, raw)
    above = (source > source.gather(1, tokens[:, None])).sum(dim=-1).tolist()
    ranks = [None if p.num_logprobs is None else n + 1 for p, n in zip(params, above, strict=True)]
    named: list[list[int] | None] | None = None
    if any(ids is not None for ids in named_ids):
        named = [None] * len(params)
        for i, ids in enumerate(named_ids):
            if ids is not None:
                values = source[i, ids]
                higher = (source[i][None, :] > values[:, None]).sum(dim=-1)
                result[i] = dict(zip(ids, values.tolist(), strict=True))
                named[i] = (higher + 1).tolist()
    if any(wanted):
        values, ids = source.topk(max(wanted), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for i, k in enumerate(wanted):
            if k:
                result[i] = dict(zip(ids[i][:k], values[i][:k], strict=True))
    return result, ranks, named
