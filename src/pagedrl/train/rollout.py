"""Rollouts: the paged engine, running on the policy's own parameter tensors, samples a group of
completions per prompt (`n = G`, so the prompt's KV blocks are computed once and forked), and the
reward functions score them.

No weights are copied or synchronised: the engine reads the very `nn.Parameter`s the optimizer
updates, and the trainer bumps the engine's weight version after every step so no prefix KV
computed under old weights is reused.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.train.advantages import combine_rewards, group_advantages, zero_std_groups
from pagedrl.train.rewards import RewardFunc, score
from pagedrl.train.tokenization import is_conversational


@dataclass
class Group:
    """One prompt and its G completions, with everything the loss and the metrics need."""

    prompt: Any
    columns: dict[str, Any]
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    texts: list[str]
    sampling_logps: list[list[float]]  # the engine's processed log-probs (the logprob contract)
    truncated: list[bool]
    rewards: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [G, F], NaN = not applicable
    total_rewards: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [G]
    advantages: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [G]


@dataclass
class Rollout:
    groups: list[Group]
    seconds: float
    generated_tokens: int
    prefix_blocks_shared: int
    rounds: int = 1


def completion_for(prompt: Any, text: str) -> Any:
    """TRL's convention: conversational prompts get message-list completions."""
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def sample_groups(llm: LLM, rows: Sequence[Mapping[str, Any]], prompt_ids: Sequence[list[int]],
                  params: SamplingParams) -> tuple[list[Group], int]:
    """Generate `params.n` completions for every row; returns the groups and the prefix blocks the
    engine shared instead of recomputing (forked prompt blocks plus prefix-cache hits)."""
    before = llm.stats()
    outputs = llm.generate(list(prompt_ids), params, use_tqdm=False)
    after = llm.stats()
    groups = []
    for row, ids, out in zip(rows, prompt_ids, outputs, strict=True):
        groups.append(Group(
            prompt=row["prompt"], columns={k: v for k, v in row.items() if k != "prompt"}, prompt_ids=list(ids),
            completion_ids=[list(c.token_ids) for c in out.outputs], texts=[c.text for c in out.outputs],
            sampling_logps=[list(c.sampled_logprobs) for c in out.outputs],
            truncated=[c.finish_reason == "length" for c in out.outputs]))
    block_size = llm.block_size
    shared = (after["num_forked_blocks"] - before["num_forked_blocks"]) + \
        (after["prefix_cache_hits"] - before["prefix_cache_hits"]) // block_size
    return groups, int(shared)


def score_groups(groups: Sequence[Group], funcs: Sequence[tuple[str, RewardFunc]],
                 weights: Sequence[float] | None) -> None:
    """Fill each group's rewards ([G, F]) and weighted totals ([G]) in one call per function."""
    prompts, completions, ids, columns = [], [], [], {}
    for g in groups:
        for text, cids in zip(g.texts, g.completion_ids, strict=True):
            prompts.append(g.prompt)
            completions.append(completion_for(g.prompt, text))
            ids.append(cids)
            for k, v in g.columns.items():
                columns.setdefault(k, []).append(v)
    rows = torch.tensor(score(funcs, prompts, completions, ids, columns), dtype=torch.float64)
    w = None if weights is None else torch.tensor(list(weights), dtype=torch.float64)
    totals = combine_rewards(rows, w)
    start = 0
    for g in groups:
        n = len(g.completion_ids)
        g.rewards, g.total_rewards = rows[start:start + n], totals[start:start + n]
        start += n


def assign_advantages(groups: Sequence[Group], scale_rewards: str) -> None:
    if not groups:
        return
    rewards = torch.stack([g.total_rewards for g in groups])  # [num_groups, G]
    adv = group_advantages(rewards, scale_rewards=scale_rewards).reshape(len(groups), -1)
    for g, a in zip(groups, adv, strict=True):
        g.advantages = a.to(torch.float32)


def has_signal(groups: Sequence[Group]) -> list[bool]:
    """Groups whose rewards do not all agree (the others carry zero advantage: DAPO drops them)."""
    zero = zero_std_groups(torch.stack([g.total_rewards for g in groups]))
    return [not bool(z) for z in zero]


def collect_rollout(llm: LLM, next_rows, encode, num_prompts: int, params: SamplingParams,
                    funcs: Sequence[tuple[str, RewardFunc]], weights: Sequence[float] | None,
                    scale_rewards: str, dynamic_sampling: bool, max_rounds: int = 4) -> Rollout:
    """`num_prompts` scored groups with advantages. With dynamic sampling, groups whose rewards
    all agree are dropped and replaced from the next prompts, for up to `max_rounds` rounds; if
    still short, dropped groups fill the gap (they add nothing to the gradient)."""
    t0 = time.perf_counter()
    kept: list[Group] = []
    dropped: list[Group] = []
    shared = tokens = rounds = 0
    while len(kept) < num_prompts and rounds < (max_rounds if dynamic_sampling else 1):
        rounds += 1
        rows = next_rows(num_prompts - len(kept))
        groups, s = sample_groups(llm, rows, [encode(r) for r in rows], params)
        shared += s
        tokens += sum(len(c) for g in groups for c in g.completion_ids)
        score_groups(groups, funcs, weights)
        if dynamic_sampling:
            for g, ok in zip(groups, has_signal(groups), strict=True):
                (kept if ok else dropped).append(g)
        else:
            kept.extend(groups)
    kept.extend(dropped[: num_prompts - len(kept)])
    assign_advantages(kept, scale_rewards)
    llm.sleep()  # the optimizer runs next: the KV cache gives its memory back until the next rollout
    return Rollout(kept, time.perf_counter() - t0, tokens, shared, rounds)
