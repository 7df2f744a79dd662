"""Reward modelling (Bradley–Terry) on the one trainer loop, and scoring with the result.

The model is the decoder backbone with a scalar `score` head (`pagedrl.model.heads`), saved as
transformers' `<Family>ForSequenceClassification` with one label, so `final/` loads in
`AutoModelForSequenceClassification` (and back here) with the same scores. A reward model
usually starts from a causal LM: the LM head is dropped and the score head drawn fresh.

Per micro-batch: one forward over rows `[prompt, chosen, rejected]` (`pagedrl.train.pair_batch`:
the prompt computed once, each answer seeing only the prompt and itself), one score per answer at
the last non-pad token of `prompt + answer`, then −log σ(r⁺ − r⁻ − margin) plus the optional
`center_rewards_coefficient`·(r⁺ + r⁻)², summed over pairs and divided by the pairs of the whole
step, as `losses.reward_model_loss` defines it.

Metrics under TRL's names: `accuracy` (r⁺ > r⁻), `margin` (mean r⁺ − r⁻), `min_reward`,
`mean_reward`, `max_reward` (over every answer of the logged steps), `num_tokens`.

`RewardModel.from_pretrained(folder).score([(prompt, response), ...], batch_size=8)` scores pairs
tokenized exactly as training tokenized them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.attention import DenseAttention
from pagedrl.model.heads import SequenceScorer, load_sequence_scorer, save_sequence_scorer, score_index
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import Metric, OfflineAlgorithm
from pagedrl.train.config import RewardConfig
from pagedrl.train.data import PreferenceRows, load_train_and_eval
from pagedrl.train.distributed import DistInfo
from pagedrl.train.losses import reward_model_loss
from pagedrl.train.pair_batch import PairBatch, collate_pairs
from pagedrl.train.tokenization import Text, tokenize_prompt_completion

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

    def save_model(self, folder: Path) -> None:
        save_sequence_scorer(self.model, folder)
        self.tokenizer.save(folder)

    def summary_lines(self) -> list[str]:
        coef = self.config.center_rewards_coefficient
        centring = f" + {coef:g}·mean((r+ + r-)^2)" if coef else ""
        return super().summary_lines() + [f"rm: loss -log sigmoid(r+ - r- - margin){centring}; "
                                          f"score at the last token that is not pad id {self.score_pad_id}"]


class RewardModel:
    """A trained reward model with its tokenizer: scores (prompt, response) pairs."""

    def __init__(self, network: SequenceScorer, tokenizer: Tokenizer, max_length: int | None = None) -> None:
        self.network, self.tokenizer, self.max_length = network, tokenizer, max_length
        self.pad_token_id = network.config.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, max_length: int | None = None) -> RewardModel:
        """Load a folder written by `pagedrl rm` (or a transformers sequence classifier)."""
        path = Path(path)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"path: {path} has no tokenizer.json; scoring text needs the model's tokenizer")
        network = load_sequence_scorer(path, device=device, dtype=dtype, new_head=False)
        return cls(network, Tokenizer.from_folder(path), max_length)

    def encode(self, prompt: Text, response: Text) -> list[int]:
        """Token ids of `prompt + response`, as the reward trainer tokenized them (EOS appended to
        a plain-text response, chat rendered with the template), cut to `max_length`."""
        prompt_ids, response_ids = tokenize_prompt_completion(self.tokenizer, prompt, response)
        ids = prompt_ids + response_ids
        return ids if self.max_length is None else ids[: self.max_length]

    @torch.no_grad()
    def score(self, pairs: Sequence[tuple[Text, Text]], batch_size: int = 8) -> list[float]:
        """One reward per (prompt, response) pair, in order; `batch_size` pairs per forward."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        encoded = []
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"pairs[{i}]: expected a (prompt, response) pair, got {type(pair).__name__}")
            for name, value in zip(("prompt", "response"), pair, strict=True):
                if not isinstance(value, (str, list)):
                    raise ValueError(f"pairs[{i}]: {name} must be a string or a list of chat messages, "
                                     f"got {type(value).__name__}")
            if type(pair[0]) is not type(pair[1]):
                raise ValueError(f"pairs[{i}]: prompt and response must both be strings or both chat messages")
            encoded.append(self.encode(*pair))
        out: list[float] = []
        self.network.eval()
        for start in range(0, len(encoded), batch_size):
            out += self._score_ids(encoded[start:start + batch_size])
        return out

    def _score_ids(self, batch: list[list[int]]) -> list[float]:
        device = self.network.device
        width = max(len(ids) for ids in batch)
        pad = 0 if self.pad_token_id is None else self.pad_token_id
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch], device=device)
        real = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=device)
        meta = DenseAttention.causal(real) if bool((real == 0).any()) else DenseAttention(None)
        hidden = self.network(ids, positions=(real.cumsum(-1) - 1).clamp(min=0), meta=meta)
        at = torch.tensor([score_index(x, self.pad_token_id) for x in batch], device=device)
        return self.network.scores(hidden[torch.arange(len(batch), device=device), at]).tolist()


def run_rm(config: RewardConfig, dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
           progress: bool = True) -> Path:
    """Train a reward model from `config.model` on `dataset` (default: `config.dataset`); returns
    `output_dir/final`, a folder `RewardModel.from_pretrained` and transformers both load."""
    from pagedrl.model.loader import resolve_model_path
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import init_distributed
    from pagedrl.train.trainer import Trainer

    dist = init_distributed(config.use_cpu)
    seed_everything(config.seed)
    path = resolve_model_path(config.model)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"model: {path} has no tokenizer.json; the reward model needs the model's tokenizer")
    head_rng = torch.Generator().manual_seed(config.seed)
    model = load_sequence_scorer(path, device=dist.device, dtype=torch.float32, generator=head_rng)
    algorithm = RewardModeling(config, model, Tokenizer.from_folder(path), dist, dataset, eval_dataset)
    return Trainer(config, algorithm, dist, progress=progress).train()
