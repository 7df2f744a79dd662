"""SEQ_CLS LoRA adapters chosen per request on the pooling runner, as vLLM serves them with `enable_lora`:
`LLM(base, runner="pooling", enable_lora=True)` then `classify(..., lora_request=LoRARequest(name, id, path))`,
and `pagedrl serve base --runner pooling --enable-lora --lora-modules name=path` with `"model": name`.

Each adapter is folded into its own copy of the base (`model/merge.py` `merged_scorer`: the adapter's `score`
head where it saved one, as `pagedrl rm --use_peft` does, else the base's), made the first time a request
names it and kept for the `max(max_loras, max_cpu_loras)` adapters used last. vLLM keeps one base and adds
each adapter's product at every layer; folding costs one model's memory per adapter kept, and scores as the
`pagedrl merge` folder of base and adapter scores (which transformers reads).

A new adapter is checked against a weightless skeleton of the base first (`model/scorer_skeleton.py`), so
one that does not fit drops nothing; then, the cache full, the least recently used copy is dropped before
the fold, and the fold runs on the CPU (in float32, as `pagedrl merge` folds) with only its result, in the
engine's dtype, moved to the device: the device never holds more than the base and `capacity` copies.

Not thread-safe: the server runs one request at a time (its busy lock, `server/pooling_app.py`), and
offline calls run on the caller's thread."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedrl.engine.lora_request import LoRARequest
from pagedrl.model.adapter import read_adapter_config
from pagedrl.model.checkpoint import CheckpointError
from pagedrl.model.heads import SequenceScorer
from pagedrl.model.merge import merged_scorer
from pagedrl.model.resolve import resolve_model_path
from pagedrl.model.scorer_skeleton import check_adapter_fits


class PoolingAdapters:
    """The folded scorers of the adapters in use, by `lora_int_id`, least recently used dropped first. It holds
    no lock: the server calls it from one request at a time (its busy lock), an offline LLM from its caller."""

    def __init__(self, base: Path, device: torch.device, dtype: torch.dtype, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None) -> None:
        self.base, self.device, self.dtype, self.max_lora_rank = base, device, dtype, max_lora_rank
        self.capacity = max(max_loras, max_cpu_loras or 0)
        self._scorers: OrderedDict[int, SequenceScorer] = OrderedDict()
        # each folded adapter's id2label, kept after its copy is dropped: a response's labels read no file
        self._labels: dict[int, dict] = {}

    def check(self, lora: LoRARequest) -> None:
        """Read the adapter's config: a SEQ_CLS adapter within max_lora_rank, or a ValueError naming it and
        what does not fit, before any weight is read."""
        try:
            config = read_adapter_config(resolve_model_path(lora.lora_path))
        except (CheckpointError, OSError) as e:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r}: {e}") from None
        if config.task_type != "SEQ_CLS":
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} is a {config.task_type} adapter; the pooling "
                             "runner serves SEQ_CLS adapters (a reward model's or classifier's)")
        if config.r > self.max_lora_rank:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} has rank {config.r}, above max_lora_rank "
                             f"{self.max_lora_rank}")

    def check_fits(self, lora: LoRARequest) -> None:
        """`check`, and the adapter's tensors against the base's shapes (a skeleton: no weight of the base
        read, no copy made); what `ServedModels` calls before serving a `--lora-modules` entry."""
        self.check(lora)
        try:
            check_adapter_fits(self.base, resolve_model_path(lora.lora_path))
        except (CheckpointError, OSError, RuntimeError) as e:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} does not fit the base {self.base}: {e}") \
                from None

    def scorer(self, lora: LoRARequest) -> SequenceScorer:
        """The base with `lora` folded in, made on first use (a ValueError naming the adapter if it does not
        fit the base), the least recently used copy dropped first when `capacity` are kept."""
        if lora.lora_int_id in self._scorers:
            self._scorers.move_to_end(lora.lora_int_id)
            return self._scorers[lora.lora_int_id]
        self.check_fits(lora)
        while len(self._scorers) >= self.capacity:
            self._scorers.popitem(last=False)
        try:
            scorer = merged_scorer(self.base, resolve_model_path(lora.lora_path), device="cpu", dtype=self.dtype,
                                   float_head=True).to(self.device)
        except (CheckpointError, OSError, RuntimeError) as e:  # RuntimeError: shapes that do not fit the base
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} does not fit the base {self.base}: {e}") \
                from None
        self._scorers[lora.lora_int_id] = scorer
        self._labels[lora.lora_int_id] = dict(scorer.config.extra.get("id2label") or {})
        return scorer

    def id2label(self, lora: LoRARequest) -> dict:
        """The adapter's config's id2label (its keys as transformers writes them, strings), read when it was
        folded; folded now if it never was."""
        if lora.lora_int_id not in self._labels:
            self.scorer(lora)
        return self._labels[lora.lora_int_id]

def loras_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                     num_prompts: int) -> list[LoRARequest | None]:
    """vLLM's `lora_request` argument: one for every prompt, or a list with one (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(f"lora_request: a LoRARequest, or a list of them, got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request: got {len(loras)} for {num_prompts} prompts")
    for i, lora in enumerate(loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request[{i}]: a LoRARequest or None, got {type(lora).__name__}")
    return loras
