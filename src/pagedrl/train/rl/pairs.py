"""Preference pairs from a verifier: sample several completions per prompt with the engine, score
them, and pair a correct one (chosen) with a wrong one (rejected). This is how the RLHF recipe and
the demo give DPO and the reward model the labelled data a human would otherwise provide, on the
same prompts GRPO and PPO train on.

A prompt with g correct and w wrong completions offers g x w pairs; up to `pairs_per_prompt` of
them are kept, taken so that every completion is used once before any is used twice (a cap of 4
from 2 correct and 3 wrong: c0-w0, c0-w1, c1-w0, c1-w1), so the pairs stay as varied as the
samples allow."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.train.examples import PromptOnly
from pagedrl.train.rl.rewards import RewardFunc
from pagedrl.train.rl.rollout import sample, score_rollout


def verifier_pairs(llm: LLM, prompts: Sequence[PromptOnly], verifier: tuple[str, RewardFunc], num_generations: int,
                   temperature: float = 1.0, max_tokens: int = 64, pairs_per_prompt: int = 1,
                   batch_prompts: int = 64) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """`{"prompt", "chosen", "rejected"}` rows and what sampling found: completions drawn, share
    correct, prompts with a pair. The rows are plain text: a conversational prompt is written as the
    chat template renders it, and each answer as the text the engine sampled, so a model trained on
    the rows sees the prompt and answer exactly as the policy produced them (the answer ends in EOS,
    not in the template's end-of-turn line), which is where PPO reads a reward model's score."""
    params = SamplingParams(n=num_generations, temperature=temperature, max_tokens=max_tokens)
    rows: list[dict[str, Any]] = []
    drawn = correct = paired = 0
    for start in range(0, len(prompts), batch_prompts):
        rollout = sample(llm, prompts[start:start + batch_prompts], params)
        score_rollout(rollout, [verifier], None)
        ok = (rollout.total_rewards >= 1.0).view(-1, num_generations)
        drawn += len(rollout)
        correct += int(ok.sum())
        for p, prompt in enumerate(rollout.prompts):
            good = [p * num_generations + k for k in range(num_generations) if ok[p, k]]
            bad = [p * num_generations + k for k in range(num_generations) if not ok[p, k]]
            if good and bad:
                paired += 1
            text = as_text(llm, prompt.prompt, prompt.template)
            for g, b in pair_order(good, bad)[:pairs_per_prompt]:
                rows.append({"prompt": text, "chosen": rollout.texts[g], "rejected": rollout.texts[b], **prompt.columns})
    llm.sleep()
    stats = {"completions": float(drawn), "correct_share": correct / max(drawn, 1),
             "prompts_with_a_pair": float(paired), "pairs": float(len(rows))}
    return rows, stats


def pair_order(good: Sequence[int], bad: Sequence[int]) -> list[tuple[int, int]]:
    """Every (correct, wrong) pair, those of earlier completions first: sorted by the later of the
    two indices, so a cap keeps pairs spread over as many completions as it can."""
    pairs = [(i, j) for i in range(len(good)) for j in range(len(bad))]
    pairs.sort(key=lambda ij: (max(ij), ij))
    return [(good[i], bad[j]) for i, j in pairs]


def as_text(llm: LLM, prompt: Any, template: Mapping[str, Any] | None = None) -> str:
    """The prompt as the policy saw it: a chat prompt rendered with the row's tools and template
    keywords, as its prompt ids were."""
    if isinstance(prompt, str):
        return prompt
    return llm.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **(template or {}))


def write_jsonl(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write rows atomically: a reader never sees half a file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
