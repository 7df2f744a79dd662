"""The gradient of a step does not depend on how it is split into micro-batches (or packed), and
equals transformers' gradient of the same loss on the same batch."""

from __future__ import annotations

import pytest
import torch
from tiny_train import MOE, arithmetic_rows, build_model_dir, sft_trainer


def step_grads(trainer) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    result = trainer.accumulate(1)
    grads = {n: p.grad.detach().clone() for n, p in trainer.module.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return result.loss, grads, result.metrics.values()


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def one_batch(tiny_train_model, tmp_path_factory):
    trainer = sft_trainer(tiny_train_model, tmp_path_factory.mktemp("one"), per_device_train_batch_size=8)
    return trainer, *step_grads(trainer)


@pytest.mark.parametrize("split", [dict(per_device_train_batch_size=2, gradient_accumulation_steps=4),
                                   dict(per_device_train_batch_size=8, padding_free=True),
                                   dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                        gradient_checkpointing=True),
                                   dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, padding_free=True)])
def test_accumulated_gradient_equals_one_batch(tiny_train_model, tmp_path, one_batch, split) -> None:
    _, loss, grads, metrics = one_batch
    trainer = sft_trainer(tiny_train_model, tmp_path, **split)
    loss2, grads2, metrics2 = step_grads(trainer)
    assert abs(loss - loss2) < 1e-5
    assert_grads_close(grads, grads2)
    for name in ("mean_token_accuracy", "entropy", "num_tokens"):
        assert metrics2[name] == pytest.approx(metrics[name], abs=1e-5), name


def test_step_loss_and_gradient_equal_transformers(tiny_train_model, one_batch) -> None:
    """Reference: LlamaForCausalLM with labels -100 on prompt and padding (mean over the batch's
    completion tokens) on the same 8 rows, in the order our epoch stream served them."""
    trainer, loss, grads, _ = one_batch
    transformers_step(trainer, tiny_train_model, loss, grads)


@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_step_with_router_loss_equals_transformers(tmp_path, family: str) -> None:
    """A mixture of experts with `output_router_logits`: the loss (cross-entropy plus the coefficient
    times the router's load-balancing loss, ~0.04 of it here) and every gradient, the router's
    included, equal transformers' on the same rows; `aux_loss` is transformers' `aux_loss`."""
    model_dir = build_model_dir(tmp_path / "model", num_experts_per_tok=2, output_router_logits=True,
                                router_aux_loss_coef=0.02, **MOE[family])
    trainer = sft_trainer(model_dir, tmp_path / "run", per_device_train_batch_size=8)
    loss, grads, metrics = step_grads(trainer)
    hf_out = transformers_step(trainer, model_dir, loss, grads)
    assert metrics["aux_loss"] == pytest.approx(hf_out.aux_loss.item(), abs=1e-6)
    assert 0.02 * hf_out.aux_loss.item() > 1e-2  # the term is there to be checked


def transformers_step(trainer, model_dir, loss: float, grads: dict[str, torch.Tensor]):
    """transformers' loss and gradients on the trainer's first step, checked equal to `loss` and `grads`."""
    from transformers import AutoModelForCausalLM

    examples = [trainer.algorithm.examples[i] for i in first_step_indices(trainer)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    width = max(len(e.input_ids) for e in examples)
    pad = trainer.algorithm.pad_id
    ids = torch.tensor([e.input_ids + [pad] * (width - len(e.input_ids)) for e in examples])
    attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in examples])
    labels = torch.tensor([[-100] * len(e.prompt_ids) + e.completion_ids + [-100] * (width - len(e.input_ids))
                           for e in examples])
    out = hf(input_ids=ids, attention_mask=attn, labels=labels)
    out.loss.backward()
    assert abs(out.loss.item() - loss) < 1e-5
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert_grads_close({n: g for n, g in grads.items() if n in hf_grads}, hf_grads)
    return out


def first_step_indices(trainer) -> list[int]:
    """Indices of the first step's examples, replayed from the same seed."""
    from pagedrl.train.algorithm import EpochStream

    stream = EpochStream(trainer.algorithm.num_examples, trainer.config.seed)
    return stream.take(trainer.algorithm.examples_per_step)


def test_loss_on_every_token_counts_prompt_tokens(tiny_train_model, tmp_path) -> None:
    rows = arithmetic_rows(4)
    trainer = sft_trainer(tiny_train_model, tmp_path, rows=rows, completion_only_loss=False)
    result = trainer.accumulate(1)
    total = sum(len(e.input_ids) - 1 for e in trainer.algorithm.examples)
    assert result.global_count == total
    trainer2 = sft_trainer(tiny_train_model, tmp_path / "b", rows=rows)
    assert trainer2.accumulate(1).global_count == sum(len(e.completion_ids) for e in trainer2.algorithm.examples)
