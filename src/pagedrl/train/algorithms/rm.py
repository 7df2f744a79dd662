"""Reward modelling (Bradley–Terry) on the one trainer loop, and scoring with the result.

The model is the decoder backbone with a scalar `score` head (`pagedrl.model.heads`), saved as
transformers' `<Family>ForSequenceClassification` with one label, so `final/` loads in
`AutoModelForSequenceClassification` (and back here) with the same scores. A reward model
usually starts from a causal LM: the LM head is dropped and the score head drawn fresh.

Per micro-batch: one forward over rows `[prompt, chosen, rejected]` (`pagedrl.train.algorithms.pair_batch`:
the prompt computed once, each answer seeing only the prompt and itself), one score per answer at
the last non-pad token of `prompt + answer`, then −log σ(r⁺ − r⁻ − margin) plus the optional
`center_rewards_coefficient`·(r⁺ + r⁻)², summed over pairs and divided by the pairs of the whole
step, as `losses.reward_model_loss` defines it.

Metrics under TRL's names: `accuracy` (r⁺ > r⁻), `margin` (mean r⁺ − r⁻), `min_reward`,
`mean_reward`, `max_reward` (over every answer of the logged steps), `num_tokens`.

With LoRA (`use_peft`) the backbone is frozen, adapters train on it and the `score` head trains
whole (PEFT's `modules_to_save`); `final/` is then a PEFT SEQ_CLS adapter folder.

`pagedrl.train.rl.reward_model.RewardModel` scores text with the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.adapter import write_adapter
from pagedrl.model.heads import SequenceScorer, load_sequence_scorer, save_sequence_scorer
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.adapters import SEQ_CLS, attach_lora, uses_lora
from pagedrl.train.algorithm import OfflineAlgorithm
from pagedrl.train.algorithms.pair_batch import PairBatch, collate_pairs
from pagedrl.train.data import load_train_and_eval
from pagedrl.train.distributed import DistInfo
from pagedrl.train.examples import PreferenceRows
from pagedrl.train.losses import reward_model_loss
from pagedrl.train.metrics import Metric
from pagedrl.train.offline_config import RewardConfig

Dataset = str | Path | Sequence[Mapping[str, Any]]


def answer_scores(model: Any, batch: PairBatch) -> torch.Tensor:
    """[2B] scores, chosen answers first, from one forward over the packed pairs."""
    hidden = model(batch.input_ids, positions=batch.positions, meta=batch.meta)
    return model.scores(hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.score_at))


class RewardModeling(OfflineAlgorithm):
    name = "rm"
    normaliser = "preference pairs"

    def __init__(self, config: RewardConfig, model: SequenceScorer, tokenizer: Tokenizer, dist: DistInfo,
                 dataset: Dataset | None = None, eval_dataset: Dataset | None = None) -> None:
        convert = PreferenceRows(tokenizer, config.max_length, config.truncation)
        examples, report, eval_examples = load_train_and_eval(
            config, dataset, eval_dataset, convert, "the reward model needs a dataset of {prompt, chosen, rejected} rows")
        super().__init__(examples, report, config.per_device_train_batch_size, config.gradient_accumulation_steps,
                         dist, config.seed, eval_examples)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        # transformers finds the scored token by the config's pad id; TRL sets it from the tokenizer.
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.score_pad_id = model.config.pad_token_id
        self.pad_id = 0 if self.score_pad_id is None else self.score_pad_id
        self.device = next(model.parameters()).device

    def collate(self, examples: Sequence[Any]) -> PairBatch:
        return collate_pairs(examples, self.pad_id, self.device, scores=True, score_pad_id=self.score_pad_id,
                             sliding_window=self.model.config.sliding_window)

    def count(self, batch: PairBatch) -> float:
        return float(batch.num_pairs)

    def loss(self, model: Any, batch: PairBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        rewards = answer_scores(model, batch)
        chosen, rejected = rewards.chunk(2)
        loss = reward_model_loss(chosen, rejected, batch.margins, self.config.center_rewards_coefficient,
                                 normaliser=global_count)
        n = batch.num_pairs
        with torch.no_grad():
            metrics = {
                "accuracy": Metric.mean((chosen > rejected).sum(), n),
                "margin": Metric.mean((chosen - rejected).sum(), n),
                "min_reward": Metric.min(rewards.min()),
                "mean_reward": Metric.mean(rewards.sum(), 2 * n),
                "max_reward": Metric.max(rewards.max()),
                "num_tokens": Metric.cumulative(batch.num_tokens),
            }
        return loss, metrics

    def save_model(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        if uses_lora(self.model):  # PEFT's SEQ_CLS adapter: LoRA layers plus the whole score head
            write_adapter(self.model, folder, self.tokenizer)
            return
        save_sequence_scorer(self.model, folder, state=state)
        self.tokenizer.save(folder)

    def summary_lines(self) -> list[str]:
        coef = self.config.center_rewards_coefficient
        centring = f" + {coef:g}·mean((r+ + r-)^2)" if coef else ""
        return super().summary_lines() + [f"rm: loss -log sigmoid(r+ - r- - margin){centring}; "
                                          f"score at the last token that is not pad id {self.score_pad_id}"]


def run_rm(config: RewardConfig, dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
           progress: bool = True) -> Path:
    """Train a reward model from `config.model` on `dataset` (default: `config.dataset`); returns
    `output_dir/final`, a folder `RewardModel.from_pretrained` and transformers both load."""
    from pagedrl.model.resolve import resolve_model_path
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import init_distributed
    from pagedrl.train.dither import dither_for_run
    from pagedrl.train.trainer import Trainer

    dist = init_distributed(config.use_cpu)
    seed_everything(config.seed)
    path = resolve_model_path(config.model, config.revision)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"model: {path} has no tokenizer.json; the reward model needs the model's tokenizer")
    head_rng = torch.Generator().manual_seed(config.seed)
    model = load_sequence_scorer(path, device=dist.device, dtype=torch.float32, generator=head_rng)
    attach_lora(config, model, SEQ_CLS, modules_to_save=["score"])  # use_peft: the head trains whole
    dither_for_run(config, dist.device, model)
    algorithm = RewardModeling(config, model, Tokenizer.from_folder(path), dist, dataset, eval_dataset)
    return Trainer(config, algorithm, dist, progress=progress).train()
