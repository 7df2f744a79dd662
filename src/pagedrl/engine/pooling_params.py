"""vLLM's `PoolingParams`: what a pooling request asks of the classifier beyond its prompt, offline
(`LLM.classify(..., pooling_params=...)`) and in /classify and /pooling bodies.

The fields are spelt as vLLM's PoolingParams spells them in the releases that have `use_activation` and
still read `softmax` and `activation` (deprecated there, removed in vLLM 0.15). Of vLLM's fields a sequence
classifier takes `truncate_prompt_tokens` (keep the prompt's last k tokens) and
`use_activation` (the classifier pooler's activation; `activation` and `softmax` are its older spellings,
read first as vLLM's `get_use_activation` reads them). `dimensions` and `normalize` are an embedding
model's: on a classify or token_classify task they are refused naming the field, as vLLM's
`PoolingParams.verify` refuses them.

Unset, `use_activation` is the task's default: on for "classify" (vLLM's), off for "token_classify"
(`reward`'s raw per-token score, which vLLM gives for a reward model's architecture; later vLLM turns the
activation on there by default)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

# vLLM's `valid_parameters`: which of its task-dependent fields each task takes
TASK_PARAMETERS = {"classify": ("use_activation",), "token_classify": ("use_activation",)}
EMBEDDING_PARAMETERS = ("dimensions", "normalize")
# the activation's spellings, in the order vLLM reads them (the deprecated ones first)
ACTIVATION_SPELLINGS = ("softmax", "activation", "use_activation")


@dataclass(kw_only=True)
class PoolingParams:
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        """Each field's type, named when wrong (a JSON body's `"use_activation": "no"` is not False)."""
        for f in fields(self):
            value = getattr(self, f.name)
            wanted = int if f.name in ("truncate_prompt_tokens", "dimensions") else bool
            if value is not None and (type(value) is not wanted):
                raise ValueError(f"{f.name}: must be {'an integer' if wanted is int else 'a boolean'} or None, "
                                 f"got {value!r}")

    def activation_for(self, task: str) -> bool:
        """Whether `task`'s outputs go through the classifier's activation: the first spelling set, else the
        task's default. A field the task does not take is a ValueError naming it."""
        unsupported = [name for name in EMBEDDING_PARAMETERS if getattr(self, name) is not None]
        if unsupported:
            raise ValueError(f"{unsupported[0]}: task {task} only supports {list(TASK_PARAMETERS[task])} (and "
                             f"truncate_prompt_tokens); {', '.join(unsupported)} "
                             f"{'is an embedding parameter' if len(unsupported) == 1 else 'are embedding parameters'}"
                             " and a classifier has no embeddings")
        for name in ACTIVATION_SPELLINGS:
            if getattr(self, name) is not None:
                return bool(getattr(self, name))
        return task == "classify"


def params_per_prompt(pooling_params: PoolingParams | Sequence[PoolingParams] | None, num_prompts: int,
                      truncate_prompt_tokens: int | None) -> list[PoolingParams]:
    """One PoolingParams per prompt: vLLM's single one for all, or a list as long as the prompts. The
    `truncate_prompt_tokens` argument (vLLM 0.10's spelling) fills the field where it is unset; the two
    set to different values are a ValueError."""
    if pooling_params is None:
        pooling_params = PoolingParams()
    if isinstance(pooling_params, PoolingParams):
        per_prompt = [pooling_params] * num_prompts
    elif isinstance(pooling_params, Sequence) and all(isinstance(p, PoolingParams) for p in pooling_params):
        per_prompt = list(pooling_params)
        if len(per_prompt) != num_prompts:
            raise ValueError(f"pooling_params: the list has {len(per_prompt)} entries for {num_prompts} prompts "
                             "(give one PoolingParams, or one per prompt)")
    else:
        raise ValueError(f"pooling_params: a PoolingParams or a list of them, got {type(pooling_params).__name__}")
    if truncate_prompt_tokens is None:
        return per_prompt
    out = []
    for params in per_prompt:
        if params.truncate_prompt_tokens not in (None, truncate_prompt_tokens):
            raise ValueError(f"truncate_prompt_tokens: given as {truncate_prompt_tokens} and as "
                             f"pooling_params.truncate_prompt_tokens={params.truncate_prompt_tokens}; give one")
        out.append(PoolingParams(**{**vars(params), "truncate_prompt_tokens": truncate_prompt_tokens}))
    return out
