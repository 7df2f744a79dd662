"""PPO's trained modules as one: the policy and the critic.

The critic is a per-token value head: a `SequenceScorer` (backbone + bias-free `score` Linear,
transformers' one-label `*ForSequenceClassification` layout) whose head is applied to every
hidden state, exactly how TRL's PPOTrainer uses its value model (`value_model.score(hidden)`). It
starts from the reward model by default (InstructGPT; "The N+ Implementation Details of RLHF with
PPO"), from the policy's weights with a fresh head, or shares the policy's backbone (`shared`:
one backbone, half the memory, one forward for both).

The trainer loop sees one module (`ActorCritic`), so one AdamW, one gradient clip and one DDP
wrapper cover both; AdamW is per parameter, so this is the same update as two optimizers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from pagedrl.model.attention import AttentionMetadata
from pagedrl.model.checkpoint import load_weights, read_state_dict
from pagedrl.model.decoder import CausalLM
from pagedrl.model.heads import (
    SequenceScorer,
    load_sequence_scorer,
    reward_architecture,
    save_sequence_scorer,
)
from pagedrl.model.tokenizer import Tokenizer

CRITIC_DIR = "critic"


class ActorCritic(nn.Module):
    """`forward` returns the policy's hidden states and the critic's (the same tensor when shared)."""

    def __init__(self, policy: CausalLM, critic: SequenceScorer | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        if critic is None:  # shared backbone: a value head on the policy's hidden states
            self.value_head = nn.Linear(policy.config.hidden_size, 1, bias=False)
            std = float(policy.config.extra.get("initializer_range", 0.02))
            with torch.no_grad():
                self.value_head.weight.normal_(0.0, std)
            self.value_head.to(device=policy.lm_head.weight.device, dtype=policy.lm_head.weight.dtype)
        self.detach_shared = False  # critic warm-up with a shared backbone: train the head only

    @property
    def shared(self) -> bool:
        return self.critic is None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.policy(input_ids, positions=positions, meta=meta)
        if self.critic is None:
            return hidden, hidden.detach() if self.detach_shared else hidden
        return hidden, self.critic(input_ids, positions=positions, meta=meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.policy.logits(hidden)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] → [...] float32 values."""
        if self.critic is None:
            return self.value_head(hidden).squeeze(-1).float()
        return self.critic.scores(hidden)

    def critic_scorer(self) -> SequenceScorer:
        """The critic as a `SequenceScorer` (for saving): its own, or one over the shared backbone."""
        if self.critic is not None:
            return self.critic
        cfg = dataclasses.replace(self.policy.config, architecture=reward_architecture(self.policy.config.architecture))
        with torch.device("meta"):
            scorer = SequenceScorer(cfg)
        scorer.model = self.policy.model
        scorer.score = self.value_head
        return scorer

    def save_critic(self, folder: Path, tokenizer: Tokenizer | None,
                    state: dict[str, torch.Tensor] | None = None) -> None:
        """`state`: whole tensors of this module (when its own are FSDP2 shards), else None."""
        out = folder / CRITIC_DIR
        critic_state = None
        if state is not None and self.critic is not None:
            critic_state = substate(state, "critic.")
        elif state is not None:  # the policy's backbone and the value head
            critic_state = {"model." + k: v for k, v in substate(state, "policy.model.").items()}
            critic_state["score.weight"] = state["value_head.weight"]
        save_sequence_scorer(self.critic_scorer(), out, state=critic_state)
        if tokenizer is not None:
            tokenizer.save(out)

    def load_critic(self, folder: Path) -> None:
        state = read_state_dict(folder / CRITIC_DIR, dtype=torch.float32)
        with torch.no_grad():
            if self.critic is not None:
                load_weights(self.critic, state, str(folder / CRITIC_DIR))
            else:  # the backbone is the policy's, loaded with it
                self.value_head.weight.copy_(state["score.weight"])


def substate(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` under `prefix`, with the prefix taken off."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_critic(init: str, policy_path: Path, reward_model_path: Path | None, device: torch.device,
                seed: int) -> SequenceScorer | None:
    """The critic's starting weights: the reward model's (score head included), or the policy's
    backbone with a fresh head drawn from `seed`; None for `shared`."""
    if init == "shared":
        return None
    if init == "reward_model":
        assert reward_model_path is not None
        return load_sequence_scorer(reward_model_path, device=device, dtype=torch.float32, new_head=False).train()
    head_rng = torch.Generator().manual_seed(seed + 1)
    return load_sequence_scorer(policy_path, device=device, dtype=torch.float32, generator=head_rng).train()
