"""A sequence scorer's shape without its weights: what the pooling runner reads of a causal LM base that
only its SEQ_CLS adapters score (its config), and what it checks a `--lora-modules` adapter against at
start-up (its tensor shapes), without a copy of the model in memory.

The skeleton is built on the meta device as `load_sequence_scorer` builds the model: a classifier
folder's head with the rows its weights hold (read from the safetensors header, not the tensor), a causal
LM's placeholder head of one label. An adapter put on it is checked tensor by tensor as folding it into
the loaded base checks it (`model/adapter.py` `load_adapter_weights`), so what fits here folds there."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from pagedrl.model.adapter import is_adapter_folder, load_adapter
from pagedrl.model.checkpoint import CheckpointError, read_folder_config, weight_files
from pagedrl.model.heads import SCORE_WEIGHT, SequenceScorer, scorer_on_meta
from pagedrl.model.resolve import adapter_base, resolve_model_path


def saved_labels(folder: Path) -> int | None:
    """The rows of the folder's saved `score.weight` (a classifier's labels), None for a causal LM;
    read from the files' headers."""
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                if SCORE_WEIGHT in f.keys():
                    return int(f.get_slice(SCORE_WEIGHT).get_shape()[0])
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None
    return None


def scorer_skeleton(folder: str | Path) -> SequenceScorer:
    """The scorer `load_sequence_scorer(folder)` loads, on the meta device: its config and shapes only."""
    folder = Path(folder)
    return scorer_on_meta(read_folder_config(folder), saved_labels(folder))


def check_adapter_fits(base: str | Path | None, adapter: str | Path) -> None:
    """A CheckpointError naming the tensor where `adapter` does not fit `base` (None: the base it names),
    as `merged_scorer` would raise it, with no weight of the base read. A base that is itself an adapter
    (a LoRA critic's reward model) is checked when it is folded."""
    adapter = resolve_model_path(adapter)
    base_path = adapter_base(adapter, base)
    if is_adapter_folder(base_path):
        return
    skeleton = scorer_skeleton(base_path)
    if skeleton.score.out_features != 1:  # `merged_scorer` loads a base of one label, as the trainers do
        raise CheckpointError(f"{base_path}: {SCORE_WEIGHT!r} has {skeleton.score.out_features} labels; a reward "
                              "model has one (num_labels=1)")
    load_adapter(skeleton, adapter)
