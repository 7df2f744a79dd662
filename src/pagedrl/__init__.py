"""pagedrl: a paged-attention inference engine and alignment trainer on the same weights."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
# vLLM's top-level names, each from the module that defines it
_EXPORTS = {
    "LLM": "pagedrl.engine.llm",
    "LoRARequest": "pagedrl.engine.lora_request",
    "BeamSearchParams": "pagedrl.engine.beam_search",
    "SamplingParams": "pagedrl.engine.sampling_params",
    "PoolingParams": "pagedrl.engine.pooling_params",
    "RequestOutputKind": "pagedrl.engine.sampling_params",
    "RequestOutput": "pagedrl.engine.outputs",
    "CompletionOutput": "pagedrl.engine.outputs",
    "StructuredOutputsParams": "pagedrl.engine.structured_outputs",
    "GuidedDecodingParams": "pagedrl.engine.structured_outputs",
}
__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "GuidedDecodingParams", "LoRARequest", "PoolingParams", "RequestOutput",
           "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

if TYPE_CHECKING:
    from pagedrl.engine.beam_search import BeamSearchParams
    from pagedrl.engine.llm import LLM
    from pagedrl.engine.lora_request import LoRARequest
    from pagedrl.engine.outputs import CompletionOutput, RequestOutput
    from pagedrl.engine.pooling_params import PoolingParams
    from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
    from pagedrl.engine.structured_outputs import GuidedDecodingParams, StructuredOutputsParams


def __getattr__(name: str):
    # Lazy, so `import pagedrl.model...` does not pull in the engine (and tqdm) for every tool.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedrl' has no attribute {name!r}")
