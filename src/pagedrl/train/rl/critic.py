"""PPO's trained modules as one: the policy and the critic.

The critic is a per-token value head: a `SequenceScorer` (backbone + bias-free `score` Linear,
transformers' one-label `*ForSequenceClassification` layout) whose head is applied to every
hidden state, exactly how TRL's PPOTrainer uses its value model (`value_model.score(hidden)`). It
starts from the reward model by default (InstructGPT; "The N+ Implementation Details of RLHF with
PPO"), from the policy's weights with a fresh head, or shares the policy's backbone (`shared`:
one backbone, half the memory, one forward for both).

With LoRA (`lora_critic`) a critic of its own trains an adapter and its head on a frozen backbone,
and a shared one trains the value head beside the policy's adapter; `critic/` then holds a PEFT
SEQ_CLS adapter either way.

The trainer loop sees one module (`ActorCritic`), so one AdamW, one gradient clip and one DDP
wrapper cover both; AdamW is per parameter, so this is the same update as two optimizers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from pagedrl.model.adapter import is_adapter_folder, load_adapter_weights, read_adapter_weights, write_adapter
from pagedrl.model.attention import AttentionMetadata
from pagedrl.model.checkpoint import load_weights, read_state_dict
from pagedrl.model.decoder import CausalLM
from pagedrl.model.heads import (
    SequenceScorer,
    load_sequence_scorer,
    reward_architecture,
    save_sequence_scorer,
)
from pagedrl.model.lora import adapter_config
from pagedrl.model.qlora_gguf import quantize_base
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.adapters import SEQ_CLS, attach_lora
from pagedrl.train.config import TrainConfig

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
        policy_adapter = adapter_config(self.policy)
        if policy_adapter is not None:  # the policy's adapter and the value head, as a SEQ_CLS adapter
            scorer.lora_config = dataclasses.replace(policy_adapter, task_type="SEQ_CLS", modules_to_save=["score"])
        return scorer

    def save_critic(self, folder: Path, tokenizer: Tokenizer | None,
                    state: dict[str, torch.Tensor] | None = None) -> None:
        """`state`: whole tensors of this module (when its own are FSDP2 shards), else None."""
        out = folder / CRITIC_DIR
        scorer = self.critic_scorer()
        if adapter_config(scorer) is not None:
            write_adapter(scorer, out, tokenizer)
            return
        critic_state = None
        if state is not None and self.critic is not None:
            critic_state = substate(state, "critic.")
        elif state is not None:  # the policy's backbone and the value head
            critic_state = {"model." + k: v for k, v in substate(state, "policy.model.").items()}
            critic_state["score.weight"] = state["value_head.weight"]
        save_sequence_scorer(scorer, out, state=critic_state)
        if tokenizer is not None:
            tokenizer.save(out)

    def load_critic(self, folder: Path) -> None:
        if is_adapter_folder(folder / CRITIC_DIR):
            if self.critic is not None:
                load_adapter_weights(self.critic, folder / CRITIC_DIR)
            else:  # the backbone's adapter is the policy's, loaded with it
                with torch.no_grad():
                    self.value_head.weight.copy_(read_adapter_weights(folder / CRITIC_DIR)["score.weight"])
            return
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
        from pagedrl.train.rl.reward_model import load_reward_model

        return load_reward_model(reward_model_path, device=device, dtype=torch.float32).train()
    head_rng = torch.Generator().manual_seed(seed + 1)
    return load_sequence_scorer(policy_path, device=device, dtype=torch.float32, generator=head_rng).train()


def lora_critic(config: TrainConfig, critic: SequenceScorer, policy: CausalLM, base: str | None = None) -> None:
    """LoRA on a critic of its own: adapters on a frozen backbone, the value head trained whole. A
    critic started from the policy holds the same base weights, so it takes the policy's frozen
    tensors themselves: one copy of the base in memory for policy, reference and critic. `base`: the
    reward model the critic started from (None: the policy), which its adapter then names as its base:
    its frozen backbone is the reward model's, not the policy's. A reward model that is itself an
    adapter folder is named as it is: pagedrl's loaders fold it into its own base first."""
    spec = config.quantized_base
    if spec is not None and config.use_peft:  # QLoRA: the same float weights quantize to the policy's bytes
        quantize_base(critic.model, spec, config.model if base is None else base, config.revision if base is None else None)
    # (an adapted quantized projection keeps its base as `base_layer`, PEFT's name)
    policy_base = {n.replace(".base_layer.", "."): t for n, t in
                   [*policy.model.named_parameters(), *policy.model.named_buffers()]}
    own = {**dict(critic.model.named_parameters()), **dict(critic.model.named_buffers())}
    if all(n in policy_base and policy_base[n].shape == p.shape and torch.equal(policy_base[n], p)
           for n, p in own.items()):
        for name in own:
            module_name, _, attr = name.rpartition(".")
            setattr(critic.model.get_submodule(module_name) if module_name else critic.model, attr, policy_base[name])
    attach_lora(config, critic, SEQ_CLS, modules_to_save=["score"], seed_offset=1, base=base)
