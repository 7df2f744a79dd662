"""GRPO's dynamic sampling (DAPO's): groups whose rewards all agree carry no signal and are replaced from
the next prompts, each further round drawing what the share kept so far says is missing, and the
dropped groups filling the batch when the rounds run out. The engine is replaced by a sampler whose
completions decide each group's rewards."""

from __future__ import annotations

import torch

from pagedrl.train.examples import PromptOnly
from pagedrl.train.rl.rollout import Rollout


def test_dynamic_sampling_keeps_groups_with_signal_and_fills_from_the_dropped(monkeypatch) -> None:
    """Groups whose rewards all agree are replaced from the next prompts; if rounds run out, dropped
    groups fill the gap. Rewards here are the completion's first token, so a group has signal
    exactly when its completions differ."""
    from pagedrl.train.rl import rollout as rollout_module

    firsts = iter([[1, 1], [1, 2], [3, 3], [4, 5], [6, 6], [7, 7], [8, 8], [9, 9], [0, 0], [2, 2]])

    def fake_sample(llm, rows, params, seeds=None):
        comps = [c for _ in rows for c in [[x] for x in next(firsts)]]
        return Rollout(list(rows), 2, comps, [""] * len(comps), [[0.0]] * len(comps),
                       torch.zeros(len(comps), dtype=torch.bool), prefix_blocks_shared=1)

    monkeypatch.setattr(rollout_module, "sample", fake_sample)
    counter = iter(range(100))

    def next_rows(n):
        return [PromptOnly([next(counter)], "p", "") for _ in range(n)], [None] * n

    funcs = [("first", lambda prompts, completions, completion_ids, **kw: [float(c[0]) for c in completion_ids])]
    r = rollout_module.collect_rollout(None, next_rows, 3, None, funcs, None, "group", dynamic_sampling=True,
                                       max_rounds=3)
    # round 1: prompts 0-2 give [1,1] [1,2] [3,3] -> keep 1 of 3, so the 2 missing take 6 prompts,
    # at most a first round's 3; round 2: prompts 3-5 give [4,5] [6,6] [7,7] -> keep 3; round 3:
    # prompts 6-8 give [8,8] [9,9] [0,0] -> none; the first dropped group (prompt 0) fills the gap.
    assert [p.prompt_ids[0] for p in r.prompts] == [1, 3, 0]
    assert r.total_rewards.tolist() == [1.0, 2.0, 4.0, 5.0, 1.0, 1.0]
    assert r.rounds == 3 and r.prefix_blocks_shared == 3
    assert r.sampled_completions == 18  # 9 prompts x 2 drawn, though 3 groups were kept
    assert r.sampled_tokens == 18  # one token each
    assert r.advantages.view(-1, 2)[2].tolist() == [0.0, 0.0] and r.advantages[0] < 0 < r.advantages[1]


def test_dynamic_sampling_draws_what_the_share_kept_says_and_leaves_out_the_excess(monkeypatch) -> None:
    """After a round that kept half its groups, the next draws twice what is missing (at most a
    first round's prompts); groups kept beyond the batch are left out, in order."""
    from pagedrl.train.rl import rollout as rollout_module

    drawn: list[int] = []
    with_signal = {1, 3, 5, 7, 9, 11, 13, 14, 16, 17}

    def fake_sample(llm, rows, params, seeds=None):
        drawn.append(len(rows))
        comps = [[int(p.prompt_ids[0] in with_signal) * j] for p in rows for j in range(2)]
        return Rollout(list(rows), 2, comps, [""] * len(comps), [[0.0]] * len(comps),
                       torch.zeros(len(comps), dtype=torch.bool))

    monkeypatch.setattr(rollout_module, "sample", fake_sample)
    counter = iter(range(100))

    def next_rows(n):
        return [PromptOnly([next(counter)], "p", "") for _ in range(n)], [None] * n

    def collect(num_prompts: int) -> list[int]:
        funcs = [("first", lambda prompts, completions, completion_ids, **kw: [float(c[0]) for c in completion_ids])]
        r = rollout_module.collect_rollout(None, next_rows, num_prompts, None, funcs, None, "group",
                                           dynamic_sampling=True)
        assert len(r.advantages) == 2 * num_prompts
        return [p.prompt_ids[0] for p in r.prompts]

    # prompts 0-3 keep 1 and 3; 2 missing at a share of 1/2 -> 4 prompts (4-7) keep 5 and 7.
    assert collect(4) == [1, 3, 5, 7] and drawn == [4, 4]
    # prompts 8-10 keep 9; 2 missing at a share of 1/3 -> 6, at most 3 (11-13): keep 11 and 13.
    assert collect(3) == [9, 11, 13] and drawn[2:] == [3, 3]
    # prompts 14-15 keep 14; 1 missing at a share of 1/2 -> 2 (16-17), both kept: 17 is left out.
    assert collect(2) == [14, 16] and drawn[4:] == [2, 2]
