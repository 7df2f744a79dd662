"""Which runner an `LLM` is (vLLM's `runner`): "generate" samples tokens from a causal LM, "pooling"
reads a sequence classifier's scores (`engine/pooling.py`), "auto" picks pooling for a local
`*ForSequenceClassification` folder or a SEQ_CLS LoRA adapter (a `pagedrl rm` checkpoint) as vLLM's
auto picks it from the architecture, and generate otherwise. Each runner refuses the other's calls in
one line that names what to use instead."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from pagedrl.model.adapter import is_adapter_folder, read_adapter_config
from pagedrl.model.config import REWARD_ARCHITECTURE_SUFFIX

RUNNERS = ("auto", "generate", "pooling")


def is_classifier_folder(model: str | Path | None) -> bool:
    """Whether `model` is a local folder holding a sequence classifier or a SEQ_CLS adapter (a Hub id is
    not looked up: name the runner for one)."""
    if model is None or not Path(model).is_dir():
        return False
    folder = Path(model)
    try:
        if is_adapter_folder(folder):
            return read_adapter_config(folder).task_type == "SEQ_CLS"
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False  # the loader names what is wrong with the folder
    return any(str(a).endswith(REWARD_ARCHITECTURE_SUFFIX) for a in architectures)


def pooling_wanted(model: str | Path | None, engine_args: Mapping[str, Any]) -> bool:
    """Whether `LLM(model, **engine_args)` is the pooling runner."""
    runner = engine_args.get("runner", "auto")
    if runner not in RUNNERS:
        raise ValueError(f"runner: {runner!r} is not one of {', '.join(RUNNERS)}")
    if runner == "auto":
        return is_classifier_folder(engine_args.get("adapter") or model)
    return runner == "pooling"


class GenerateRunner:
    """What a generating `LLM` answers to the pooling runner's calls."""

    def _pooling_only(self, name: str) -> NoReturn:
        raise ValueError(f"LLM.{name}() is only supported for pooling models; this LLM generates. Load a "
                         "*ForSequenceClassification folder or a SEQ_CLS adapter with LLM(model, runner='pooling')")

    def classify(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._pooling_only("classify")

    def reward(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._pooling_only("reward")

    def encode(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._pooling_only("encode")
