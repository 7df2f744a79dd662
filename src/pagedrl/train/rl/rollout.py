"""Rollouts: the paged engine, running on the policy's own parameter tensors, samples a group of
completions per prompt (`n = G`, so the prompt's KV blocks are computed once and forked), and the
reward functions score them.

No weights are copied or synchronised: the engine reads the very `nn.Parameter`s the optimizer
updates, and the trainer bumps the engine's weight version after every step so no prefix KV
computed under old weights is reused.

A rollout is flat and prompt-major: completion i answers prompt i // G, so every per-group
statistic is a `view(-1, G)` of a flat tensor, with no per-group objects in between.

Under torchrun each rank samples its own share of the prompts with its own engine (data-parallel
rollouts). Every prompt carries its own sampling seed, drawn from the run's seed and the prompt's
place in the run, so a prompt is sampled the same way whichever rank draws it and however many
ranks there are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.train.distributed import DistInfo, gather_objects
from pagedrl.train.examples import PromptOnly
from pagedrl.train.rl.advantages import combine_rewards, group_advantages, zero_std_groups
from pagedrl.train.rl.rewards import RewardFunc, score
from pagedrl.train.tokenization import is_conversational


def _empty() -> torch.Tensor:
    return torch.empty(0)


@dataclass
class Rollout:
    """P prompts × G completions, flat: completion i answers `prompts[i // G]`."""

    prompts: list[PromptOnly]
    num_generations: int
    completion_ids: list[list[int]]  # [P·G] token ids as sampled
    texts: list[str]  # [P·G]
    sampling_logps: list[list[float]]  # [P·G] the engine's processed log-probs (the logprob contract)
    truncated: torch.Tensor  # [P·G] bool: stopped by max_tokens, without EOS
    rewards: torch.Tensor = field(default_factory=_empty)  # [P·G, F] float64, NaN = not applicable
    total_rewards: torch.Tensor = field(default_factory=_empty)  # [P·G] float64, weighted sum
    advantages: torch.Tensor = field(default_factory=_empty)  # [P·G] float32 (GRPO's group baseline)
    batch_rewards: torch.Tensor = field(default_factory=_empty)  # [world·P·G] every rank's total_rewards, rank order
    seconds: float = 0.0
    prefix_blocks_shared: int = 0
    rounds: int = 1
    sampled_completions: int = 0  # drawn by this rank over all rounds, dropped groups included
    sampled_tokens: int = 0  # their tokens: what the engine generated for this rollout

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def prompt_of(self, i: int) -> PromptOnly:
        return self.prompts[i // self.num_generations]

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.long)

    @property
    def generated_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    def completions(self) -> list[Any]:
        """Each completion as TRL passes it to reward functions: conversational prompts get
        message-list completions."""
        return [completion_for(self.prompt_of(i).prompt, t) for i, t in enumerate(self.texts)]

    def sample_rows(self, k: int, reward_names: Sequence[str], **per_completion: torch.Tensor) -> list[dict[str, Any]]:
        """The first `k` completions as log rows: prompt, completion, each reward, and any other
        per-completion value given (an advantage, a score)."""
        rows = []
        for i in range(min(k, len(self))):
            prompt = self.prompt_of(i).prompt
            row: dict[str, Any] = {"prompt": prompt[-1]["content"] if is_conversational(prompt) else prompt,
                                   "completion": self.texts[i]}
            if self.rewards.numel():
                row.update({name: float(self.rewards[i, f]) for f, name in enumerate(reward_names)})
            row.update({name: float(values[i]) for name, values in per_completion.items()})
            rows.append(row)
        return rows

    def select(self, prompt_indices: Sequence[int]) -> Rollout:
        """The rollout of some of its prompts (all G completions of each), in the given order."""
        G = self.num_generations
        rows = [p * G + j for p in prompt_indices for j in range(G)]
        index = torch.tensor(rows, dtype=torch.long)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, index) if t.numel() else t

        return replace(self, prompts=[self.prompts[p] for p in prompt_indices],
                       completion_ids=[self.completion_ids[r] for r in rows], texts=[self.texts[r] for r in rows],
                       sampling_logps=[self.sampling_logps[r] for r in rows], truncated=pick(self.truncated),
                       rewards=pick(self.rewards), total_rewards=pick(self.total_rewards),
                       advantages=pick(self.advantages), batch_rewards=_empty())  # not the selection's batch

    @staticmethod
    def cat(parts: Sequence[Rollout]) -> Rollout:
        first = parts[0]

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts])

        return Rollout([p for r in parts for p in r.prompts], first.num_generations,
                       [c for r in parts for c in r.completion_ids], [t for r in parts for t in r.texts],
                       [s for r in parts for s in r.sampling_logps], cat("truncated"), cat("rewards"),
                       cat("total_rewards"), cat("advantages"))


def completion_for(prompt: Any, text: str) -> Any:
    """TRL's convention: conversational prompts get message-list completions."""
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def prompt_seed(run_seed: int, position: int) -> int:
    """The sampling seed of the prompt at `position` in the run's stream of prompts (64-bit)."""
    return (run_seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) % 2**64


def sample(llm: LLM, rows: Sequence[PromptOnly], params: SamplingParams,
           seeds: Sequence[int | None] | None = None) -> Rollout:
    """Generate `params.n` completions for every row, row i from its own `seeds[i]` when given.
    `prefix_blocks_shared` counts the prefix blocks the engine shared instead of recomputing
    (forked prompt blocks plus prefix-cache hits)."""
    t0 = time.perf_counter()
    if not rows:
        return Rollout([], params.n, [], [], [], torch.zeros(0, dtype=torch.bool))
    per_row: SamplingParams | list[SamplingParams] = params
    if seeds is not None:
        per_row = [replace(params, seed=s) for s in seeds]
    before = llm.stats()
    outputs = llm.generate([r.prompt_ids for r in rows], per_row, use_tqdm=False)
    after = llm.stats()
    samples = [c for out in outputs for c in out.outputs]
    block_size = llm.block_size
    shared = (after["num_forked_blocks"] - before["num_forked_blocks"]) + \
        (after["prefix_cache_hits"] - before["prefix_cache_hits"]) // block_size
    return Rollout(list(rows), params.n, [list(c.token_ids) for c in samples], [c.text for c in samples],
                   [list(c.processed_logprobs) for c in samples],
                   torch.tensor([c.finish_reason == "length" for c in samples], dtype=torch.bool),
                   seconds=time.perf_counter() - t0, prefix_blocks_shared=int(shared))


def score_rollout(rollout: Rollout, funcs: Sequence[tuple[str, RewardFunc]], weights: Sequence[float] | None) -> None:
    """Fill the rollout's rewards ([P·G, F]) and weighted totals ([P·G]), one call per function."""
    if not len(rollout):  # a rank with no prompts this round
        rollout.rewards = torch.zeros(0, len(funcs), dtype=torch.float64)
        rollout.total_rewards = torch.zeros(0, dtype=torch.float64)
        return
    columns: dict[str, list[Any]] = {}
    for i in range(len(rollout)):
        for k, v in rollout.prompt_of(i).columns.items():
            columns.setdefault(k, []).append(v)
    prompts = [rollout.prompt_of(i).prompt for i in range(len(rollout))]
    rows = torch.tensor(score(funcs, prompts, rollout.completions(), rollout.completion_ids, columns),
                        dtype=torch.float64).reshape(len(rollout), len(funcs))
    rollout.rewards = rows
    rollout.total_rewards = combine_rewards(rows, None if weights is None else torch.tensor(list(weights),
                                                                                           dtype=torch.float64))


def has_signal(rollout: Rollout) -> torch.Tensor:
    """[P] bool: groups whose rewards do not all agree (the others carry zero advantage: DAPO drops them)."""
    return ~zero_std_groups(rollout.total_rewards.view(-1, rollout.num_generations))


NextRows = Callable[[int], tuple[list[PromptOnly], list[int | None]]]


def gather_rollout(part: Rollout, dist: DistInfo) -> Rollout:
    """Every rank's (scored) rollout, concatenated in rank order, on every rank."""
    parts = [p for p in gather_objects(part, dist) if len(p)]
    return Rollout.cat(parts) if parts else part


def collect_rollout(llm: LLM, next_rows: NextRows, num_prompts: int, params: SamplingParams,
                    funcs: Sequence[tuple[str, RewardFunc]], weights: Sequence[float] | None,
                    scale_rewards: str | None, dynamic_sampling: bool, max_rounds: int = 4,
                    dist: DistInfo | None = None) -> Rollout:
    """`num_prompts` scored groups per rank with GRPO's group advantages (`scale_rewards` None: none, for
    a caller that sets its own from `batch_rewards`, the whole batch's rewards gathered once here). `next_rows(k)` gives this
    rank's share of the run's next k prompts (over all ranks) and their seeds. With dynamic
    sampling, groups whose rewards all agree are dropped and replaced from the next prompts, for
    up to `max_rounds` rounds; if still short, dropped groups fill the gap (they add nothing to
    the gradient). A later round draws as many prompts as the share kept so far says it needs (at
    most a first round's), as DAPO over-samples its generation batch: each round costs about as
    many decode steps whatever its size, so refilling one lost group at a time cost a demo step up
    to four rounds where two do; groups kept beyond the batch are left out.

    Across ranks every statistic is one process's over the whole batch, as TRL gathers rewards
    before its advantages: the rewards of all ranks set the advantages (a `batch` std is the std
    of every rank's rewards); with dynamic sampling each round's groups are gathered, so which
    groups are kept, how many rounds run and which groups fill a gap are decided over all ranks,
    and each rank then trains on its contiguous slice of the kept groups."""
    t0 = time.perf_counter()
    world = dist.world_size if dist is not None else 1
    total = num_prompts * world
    kept: list[Rollout] = []
    dropped: list[Rollout] = []
    have = rounds = shared = drawn = asked = tokens = 0
    while have < total and rounds < (max_rounds if dynamic_sampling else 1):
        rounds += 1
        need = total - have
        ask = need if rounds == 1 else min(total, -(-need * asked // max(have, 1)))  # need / share kept
        rows, seeds = next_rows(ask)
        asked += ask
        part = sample(llm, rows, params, seeds)
        drawn += len(part)
        tokens += part.generated_tokens
        shared += part.prefix_blocks_shared
        score_rollout(part, funcs, weights)
        if dynamic_sampling and dist is not None and dist.distributed:
            part = gather_rollout(part, dist)
        if dynamic_sampling:
            ok = has_signal(part)
            good = [p for p in range(part.num_prompts) if ok[p]]
            kept.append(part.select(good))
            dropped.append(part.select([p for p in range(part.num_prompts) if not ok[p]]))
            have += len(good)
        else:
            kept.append(part)  # this rank's share of all `total` prompts
            have = total
    if have < total:
        spare = Rollout.cat(dropped)
        kept.append(spare.select(range(total - have)))
    rollout = Rollout.cat(kept)
    if rollout.num_prompts > total:  # a later round kept more than it needed
        rollout = rollout.select(range(total))
    totals = rollout.total_rewards
    if world > 1 and not dynamic_sampling:  # each rank holds its own groups: gather their rewards
        totals = torch.cat(gather_objects(totals, dist))
    advantages = None
    if scale_rewards is not None:
        advantages = group_advantages(totals.view(-1, rollout.num_generations), scale_rewards=scale_rewards)
        advantages = advantages.reshape(-1).to(torch.float32)
    if world > 1:
        rank, G = dist.rank, rollout.num_generations
        if dynamic_sampling:  # every rank holds all kept groups: keep this rank's slice
            rollout = rollout.select(range(rank * num_prompts, (rank + 1) * num_prompts))
        if advantages is not None:
            advantages = advantages[rank * num_prompts * G:(rank + 1) * num_prompts * G]
    if advantages is not None:
        rollout.advantages = advantages
    rollout.batch_rewards = totals
    rollout.rounds, rollout.prefix_blocks_shared, rollout.seconds = rounds, shared, time.perf_counter() - t0
    rollout.sampled_completions, rollout.sampled_tokens = drawn, tokens
    return rollout
