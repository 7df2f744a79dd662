"""What the pooling runner returns, in vLLM's classes (`vllm/outputs.py`): a request's pooled tensor
(`PoolingOutput.data`) with its id and prompt ids, and the classification view of it, whose `probs` are
that tensor as a list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

_O = TypeVar("_O")


@dataclass
class PoolingOutput:
    """`data`: [num_labels] for a sequence's classification, [num_tokens, num_labels] for a reward per token."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        data = pooling_output.data
        if data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput[PoolingOutput]) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(request_output.request_id,
                                           ClassificationOutput.from_base(request_output.outputs),
                                           request_output.prompt_token_ids, request_output.finished)
