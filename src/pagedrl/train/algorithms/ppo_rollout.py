"""PPO's no-grad pass over a fresh rollout: everything that stays fixed while it is trained on.

Once per rollout, in the packed layout PPO trains in, one forward of the actor-critic gives the
policy's log-probs (the ratio's denominator, under the rollout's own sampling params) and the
critic's values; the frozen reference gives its log-probs for the KL penalty and the reward model
its score at each completion's last token. It lives apart from `ppo.py` because it is a pure
function of the modules and the rollout: the algorithm decides when a rollout starts and what to
do with these tensors (reward shaping, GAE), this decides only how they are computed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.heads import SequenceScorer
from pagedrl.model.lora import disable_adapter
from pagedrl.train.logprobs import logprobs_from_hidden, target_logprobs
from pagedrl.train.rl.critic import ActorCritic
from pagedrl.train.rl.packing import PackedBatch
from pagedrl.train.rl.rollout import Rollout


@dataclass
class RolloutTensors:
    """What one rollout is trained on, per completion ([C]) or per token ([C, L]), prompt-major."""

    mask: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor
    old_values: torch.Tensor
    scores: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


@torch.no_grad()
def rollout_tensors(rollout: Rollout, batches: Iterable[PackedBatch], model: ActorCritic, reference: nn.Module | None,
                    reward_model: SequenceScorer | None, sampling: SamplingParams, bf16: bool) -> RolloutTensors:
    """The fixed tensors of `rollout`, computed over `batches` (its completions, each once).
    `reference` is the frozen reference (None: no KL penalty; the policy itself when its base,
    adapters off, is the reference); without a reward model the scores are the rollout's rewards.
    Rewards, advantages and returns are left at zero for the algorithm to fill."""
    C = len(rollout)
    lengths = rollout.lengths
    L = int(lengths.max())
    device = next(model.policy.parameters()).device
    mask = (torch.arange(L)[None] < lengths[:, None]).to(device)
    old, ref, values = (torch.zeros(C, L, device=device) for _ in range(3))
    scores = torch.zeros(C, device=device)
    data = RolloutTensors(mask, old, ref, values, scores, *(torch.zeros(C, L, device=device) for _ in range(3)))
    model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for b in batches:
            Lb = b.mask.shape[1]
            rows = b.completion_index
            hidden, value_hidden = model(b.input_ids, positions=b.positions, meta=b.meta)
            lp = logprobs_from_hidden(model.logits, hidden, b.predict_at, b.targets, sampling)
            old[rows, :Lb] = b.to_padded(lp.logps)
            flat = value_hidden.reshape(-1, value_hidden.shape[-1]).index_select(0, b.predict_at)
            values[rows, :Lb] = b.to_padded(model.values(flat))
            if reference is not None:
                with disable_adapter(reference):
                    ref[rows, :Lb] = b.to_padded(target_logprobs(reference, b.input_ids, b.positions, b.meta,
                                                                 b.predict_at, b.targets, sampling).logps)
            if reward_model is not None:
                h = reward_model(b.input_ids, positions=b.positions, meta=b.meta)
                at = reward_rows(b, reward_model.config.pad_token_id)
                scores[rows] = reward_model.scores(h.reshape(-1, h.shape[-1]).index_select(0, at))
    model.train()
    if reward_model is None:
        scores.copy_(rollout.total_rewards.to(device=device, dtype=torch.float32))
    return data


def reward_rows(b: PackedBatch, pad_token_id: int | None) -> torch.Tensor:
    """[S] rows whose hidden state the reward model scores: where it was trained to read, the last
    token of the completion that is not its pad id (transformers' rule, which `pagedrl rm` and TRL
    follow). Each completion's end comes from its length; only its final token is compared with the
    pad id, so a pad id that is also EOS (SmolLM2) moves the read to the token before that EOS."""
    if pad_token_id is None:
        return b.last_at
    last_token = b.input_ids[0].index_select(0, b.last_at)
    step_back = (last_token == pad_token_id) & (b.lengths > 1)
    return b.last_at - step_back.long()
