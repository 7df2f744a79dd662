"""pagedrl: a paged-attention inference engine and alignment trainer on the same weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams"]

if TYPE_CHECKING:
    from pagedrl.engine.llm import LLM
    from pagedrl.engine.lora_request import LoRARequest
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    # Lazy, so `import pagedrl.model...` does not pull in the engine (and tqdm) for every tool.
    if name == "LLM":
        from pagedrl.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from pagedrl.engine.lora_request import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from pagedrl.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from pagedrl.engine.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
