"""A trained reward model as a scorer: (prompt, response) pairs in, one scalar each out.

Used by PPO (the frozen reward model) and by anyone scoring text with a `pagedrl rm` checkpoint
or a transformers sequence classifier. Pairs are tokenized exactly as the reward trainer
tokenized them, and the score is read at the last token that is not the pad id, as training read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pagedrl.model.heads import SequenceScorer, last_scores
from pagedrl.model.merge import load_reward_model
from pagedrl.model.resolve import resolve_model_path
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.tokenization import Text, tokenize_prompt_completion


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
        """Load a folder written by `pagedrl rm` (or a transformers sequence classifier, or a
        SEQ_CLS LoRA adapter: `pagedrl rm` with use_peft)."""
        path = resolve_model_path(path)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"path: {path} has no tokenizer.json; scoring text needs the model's tokenizer")
        network = load_reward_model(path, device=device, dtype=dtype)
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
        return last_scores(self.network, batch, self.pad_token_id).tolist()
