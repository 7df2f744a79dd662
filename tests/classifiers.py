"""Sequence classifiers written by transformers over the tiny training model, for the pooling tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def saved_classifier(tiny_train_model: Path, folder: Path, names: dict[int, str]):
    """A LlamaForSequenceClassification of len(names) labels saved by transformers in `folder` with the
    tokenizer, its head drawn wide enough that the probabilities spread; returns the model itself."""
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tiny_train_model), num_labels=len(names), dtype=torch.float32, id2label=names,
        label2id={v: k for k, v in names.items()}).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0.0, 0.5)
    hf.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_train_model / name, folder / name)
    return hf
