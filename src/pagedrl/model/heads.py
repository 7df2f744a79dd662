"""A scalar head on the decoder backbone: the reward model, in transformers' layout.

`SequenceScorer` is what transformers calls `LlamaForSequenceClassification` (or `Qwen2…`,
`Qwen3…`, `Mistral…`) with `num_labels=1`: the same backbone under `model.*` and one bias-free
`score` Linear(hidden, 1) instead of the LM head. Keeping the names means a folder written here
loads in `AutoModelForSequenceClassification` and gives the same scores, and a folder trained
there loads here.

Where the score is read: transformers takes the rightmost token that is not `pad_token_id`
(`score_index`). When the pad token is also EOS (SmolLM2), a sequence that ends in EOS is scored
at the token before it; following the same rule keeps our scores equal to theirs.

A reward model usually starts from a causal LM: its backbone weights are taken as they are, the
LM head is dropped and `score` is drawn from normal(0, initializer_range), as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedrl.model.attention import AttentionMetadata, DenseAttention
from pagedrl.model.checkpoint import (
    CheckpointError,
    default_dtype,
    load_weights,
    read_folder_config,
    read_state_dict,
    save_checkpoint,
)
from pagedrl.model.config import REWARD_ARCHITECTURE_SUFFIX, ConfigError, ModelConfig
from pagedrl.model.decoder import Backbone, default_positions

SCORE_WEIGHT = "score.weight"
# What transformers writes for a one-label classifier; `num_labels` alone is not a saved field.
ONE_LABEL = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def head_labels(extra: dict[str, Any], num_labels: int) -> dict[str, Any]:
    """The folder's `id2label` / `label2id` when they name as many labels as the head has (a classifier
    trained with its own label names: /classify answers with them, as vLLM does), else transformers'
    defaults, LABEL_i (a causal LM's config may carry a two-label default its new head does not have)."""
    id2label = extra.get("id2label")
    if isinstance(id2label, dict) and len(id2label) == num_labels:
        label2id = extra.get("label2id")
        if not (isinstance(label2id, dict) and len(label2id) == num_labels):
            label2id = {name: int(i) for i, name in id2label.items()}
        return {"id2label": {str(i): name for i, name in id2label.items()}, "label2id": label2id}
    if num_labels == 1:
        return dict(ONE_LABEL)
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
            "label2id": {f"LABEL_{i}": i for i in range(num_labels)}}


def reward_architecture(architecture: str) -> str:
    """`LlamaForCausalLM` → `LlamaForSequenceClassification` (unchanged if already a classifier)."""
    if architecture.endswith(REWARD_ARCHITECTURE_SUFFIX):
        return architecture
    if not architecture.endswith("ForCausalLM"):
        raise ConfigError(f"architectures: {architecture!r} is neither a causal LM nor a sequence classifier")
    return architecture[: -len("ForCausalLM")] + REWARD_ARCHITECTURE_SUFFIX


class SequenceScorer(nn.Module):
    """Backbone + `score` head. `forward` returns hidden states (as `CausalLM` does), `scores`
    projects only the rows asked for: one per sequence, not one per token. A reward model has one label;
    the pooling runner also loads a classifier of several (`num_labels`), which `logits` reads."""

    def __init__(self, cfg: ModelConfig, num_labels: int = 1) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if positions is None:
            positions = default_positions(input_ids, attention_mask)
        if meta is None:
            meta = DenseAttention.causal(attention_mask, self.config.sliding_window,
                                         seq_len=input_ids.shape[1], device=input_ids.device)
        return self.model(input_ids, positions, meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] → [..., num_labels] float32, in the head's precision (float32 where `cast` kept it
        so: the states are raised to it first, as vLLM's pooling head takes them)."""
        return self.score(hidden.to(self.score.weight.dtype)).float()

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] → [...] float32 scores of a one-label head (a reward model's)."""
        return self.logits(hidden).squeeze(-1)

    def cast(self, device: str | torch.device, dtype: torch.dtype, float_head: bool = False) -> SequenceScorer:
        """The backbone in `dtype` on `device`; with `float_head` the score head stays in float32 (vLLM keeps a
        pooling model's head in float32, so a bf16 model's scores are not rounded to bf16)."""
        self.model.to(device=device, dtype=dtype)
        self.score.to(device=device, dtype=torch.float32 if float_head else dtype)
        return self

    @property
    def device(self) -> torch.device:
        return self.score.weight.device


def score_index(ids: Sequence[int], pad_token_id: int | None) -> int:
    """Index of the token whose hidden state is scored: the rightmost one that is not the pad
    token (transformers' rule; 0 if every token is the pad token), or the last one without a pad
    token."""
    if pad_token_id is None:
        return len(ids) - 1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] != pad_token_id:
            return i
    return 0


def padded_hidden(model: SequenceScorer, batch: list[list[int]], pad_token_id: int | None) -> torch.Tensor:
    """[B, T, hidden] hidden states of `batch` in one forward: right-padded with the pad token (0 without
    one) and masked, so each sequence's states are those it has alone. The config's sliding window (Mistral
    v0.1, Qwen2 with `use_sliding_window`) limits every layer's keys, as the reward trainer and transformers
    apply it; right padding keeps a row's positions its indices, so the window is measured by index."""
    device = model.device
    width = max(len(ids) for ids in batch)
    pad = 0 if pad_token_id is None else pad_token_id
    ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch], device=device)
    real = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=device)
    meta = DenseAttention.causal(real if bool((real == 0).any()) else None, model.config.sliding_window,
                                 seq_len=width, device=device)
    return model(ids, positions=default_positions(ids, real), meta=meta)


def last_logits(model: SequenceScorer, batch: list[list[int]], pad_token_id: int | None) -> torch.Tensor:
    """[B, num_labels] float32: each sequence's head output at `score_index`, the token the reward trainer,
    PPO's reward scorer and transformers read."""
    hidden = padded_hidden(model, batch, pad_token_id)
    at = torch.tensor([score_index(x, pad_token_id) for x in batch], device=hidden.device)
    return model.logits(hidden[torch.arange(len(batch), device=hidden.device), at])


def last_scores(model: SequenceScorer, batch: list[list[int]], pad_token_id: int | None) -> torch.Tensor:
    """[B] float32: each sequence's score (a one-label head's `last_logits`)."""
    return last_logits(model, batch, pad_token_id).squeeze(-1)


def scorer_on_meta(cfg: ModelConfig, saved_labels: int | None) -> SequenceScorer:
    """The scorer of a folder's config on the meta device (no memory): its head of `saved_labels` rows
    (a classifier's, with their id2label), or None for a causal LM's placeholder head of one label."""
    cfg.architecture = reward_architecture(cfg.architecture)
    cfg.extra.update(dict(ONE_LABEL) if saved_labels is None else head_labels(cfg.extra, saved_labels))
    cfg.extra.pop("num_labels", None)
    with torch.device("meta"):
        return SequenceScorer(cfg, 1 if saved_labels is None else saved_labels)


def load_sequence_scorer(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                         generator: torch.Generator | None = None, new_head: bool = True,
                         float_head: bool = False, any_labels: bool = False) -> SequenceScorer:
    """A reward model from a Hugging Face folder: a saved classifier (`score.weight` present), or,
    with `new_head`, a causal LM whose LM head is replaced by a `score` head drawn with `generator`.
    `float_head`: the head kept in float32 whatever `dtype` (`SequenceScorer.cast`). `any_labels`: a
    classifier of several labels is loaded too (the pooling runner's; the trainers take one)."""
    folder = Path(folder)
    cfg = read_folder_config(folder)
    origins: dict[str, str] = {}
    state = read_state_dict(folder, origins=origins)
    fresh_head = SCORE_WEIGHT not in state
    if fresh_head and cfg.architecture.endswith(REWARD_ARCHITECTURE_SUFFIX):
        raise CheckpointError(f"{folder}: config.json says {cfg.architecture} but the weights hold no {SCORE_WEIGHT!r}")
    if fresh_head and not new_head:
        raise CheckpointError(f"{folder}: holds no {SCORE_WEIGHT!r}; it is a causal LM, not a trained reward model")
    if fresh_head:
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    elif state[SCORE_WEIGHT].shape[0] != 1 and not any_labels:
        raise CheckpointError(f"{origins[SCORE_WEIGHT]}: {SCORE_WEIGHT!r} has {state[SCORE_WEIGHT].shape[0]} labels; "
                              "a reward model has one (num_labels=1)")
    model = scorer_on_meta(cfg, None if fresh_head else int(state[SCORE_WEIGHT].shape[0])).to_empty(device="cpu")
    model.model.reset_rope()
    if fresh_head:
        std = float(cfg.extra.get("initializer_range", 0.02))
        state[SCORE_WEIGHT] = torch.randn(1, cfg.hidden_size, generator=generator) * std
    load_weights(model, state, str(folder), origins)
    return model.cast(device, dtype or default_dtype(device), float_head).eval()


def save_sequence_scorer(model: SequenceScorer, folder: str | Path, **kwargs: Any) -> Path:
    """Write a Hugging Face folder that `AutoModelForSequenceClassification` loads as this model."""
    return save_checkpoint(model, folder, extra_config=head_labels(model.config.extra, model.score.out_features),
                           **kwargs)  # type: ignore[arg-type]
