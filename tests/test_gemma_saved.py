"""A saved tiny Gemma 3 folder (the trainers' tokenizer, a 4-token window the rows cross): the first
batch of SFT and DPO against transformers' own class on the same weights (loss and every parameter's
gradient), and `pagedrl serve` answering with the offline engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from first_batches import (
    answer_logp,
    assert_first_dpo_batch_equals_transformers,
    assert_gradients_equal,
    theirs,
)
from server_process import assert_serves_the_engines_text
from tiny_train import build_model_dir, sft_trainer

from pagedrl.train.algorithms.sft import collate_sft

GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], sliding_window=4, head_dim=16, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> tuple[str, str]:
    """A policy and a different reference, both Gemma 3 with the trainers' tokenizer."""
    root = tmp_path_factory.mktemp("gemma")
    return (str(build_model_dir(root / "policy", seed=0, **GEMMA3)),
            str(build_model_dir(root / "reference", seed=1, **GEMMA3)))


def test_sft_first_batch_equals_transformers(gemma_dirs, tmp_path) -> None:
    trainer = sft_trainer(gemma_dirs[0], tmp_path / "out", packing=False)
    alg = trainer.algorithm
    examples = alg.examples[:4]
    assert max(len(ex.input_ids) for ex in examples) > 2 * 4  # the window is crossed
    batch = alg.collate(examples)
    count = torch.tensor(alg.count(batch))
    loss, _ = alg.loss(alg.model, batch, count)
    loss.backward()
    hf = theirs(gemma_dirs[0])
    ref = -sum(answer_logp(hf, ex.prompt_ids, ex.input_ids[len(ex.prompt_ids):]) for ex in examples) / count
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5
    assert_gradients_equal(alg.model, hf)
    # Packed into one row (positions restart per example, so each window is counted in its own example).
    with torch.no_grad():
        packed, _ = alg.loss(alg.model, collate_sft(examples, alg.pad_id, alg.device, packing=True), count)
    assert abs(float(packed) - float(ref)) < 1e-5


def test_dpo_first_batch_equals_transformers(gemma_dirs, tmp_path) -> None:
    assert_first_dpo_batch_equals_transformers(gemma_dirs[0], gemma_dirs[1], tmp_path / "out",
                                               longer_than=2 * 4)  # the window (4) is crossed


def test_serve_answers_with_the_offline_engines_tokens(gemma_dirs, tmp_path) -> None:
    assert_serves_the_engines_text(gemma_dirs[0], tmp_path, prompt="the cat sat on the mat and a dog ran in the park",
                                   kv_cache_tokens=512, max_tokens=6)
