"""The gradient of a step does not depend on how it is split into micro-batches (or packed), and
equals transformers' gradient of the same loss on the same batch."""

from __future__ import annotations

import decoder_bound
import gradient_bound
import pytest
import torch
from float_bounds import entropy_bound, log_softmax_bounds
from tiny_train import arithmetic_rows, sft_trainer


def step_grads(trainer) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    result = trainer.accumulate(1)
    grads = {n: p.grad.detach().clone() for n, p in trainer.module.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return result.loss, grads, result.metrics.values()


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


def assert_grads_within(grads: dict[str, torch.Tensor], exact: dict[str, decoder_bound.Probed]) -> None:
    """Each gradient within float32's bound of the exact one (`gradient_bound`)."""
    assert grads.keys() == exact.keys()
    for name, g in grads.items():
        assert ((g.double() - exact[name].exact).abs() <= exact[name].bound()).all(), name


@pytest.fixture(scope="module")
def one_batch(tiny_train_model, tmp_path_factory):
    trainer = sft_trainer(tiny_train_model, tmp_path_factory.mktemp("one"), per_device_train_batch_size=8)
    return trainer, *step_grads(trainer)


def padded_step(trainer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first step's 8 rows right-padded, their mask, and the flat rows predicting each completion
    token with those tokens."""
    examples = [trainer.algorithm.examples[i] for i in first_step_indices(trainer)]
    width = max(len(e.input_ids) for e in examples)
    pad = trainer.algorithm.pad_id
    ids = torch.tensor([e.input_ids + [pad] * (width - len(e.input_ids)) for e in examples])
    attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in examples])
    rows = torch.tensor([b * width + j for b, e in enumerate(examples)
                         for j in range(len(e.prompt_ids) - 1, len(e.input_ids) - 1)])
    targets = torch.tensor([t for e in examples for t in e.completion_ids])
    return ids, attn, rows, targets


@pytest.fixture(scope="module")
def exact_step(one_batch):
    """The first step's exact loss and gradients with float32's bounds (`gradient_bound`: ~1e-6 on
    gradients of ~1e-2, where a token left out of the mean moves them by ~1e-4), and its exact
    metrics with theirs: the mean entropy (float32 log-probs' errors and the entropy's own roundings)
    and the share of tokens whose argmax float32 cannot swap."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    trainer = one_batch[0]
    ids, attn, rows, targets = padded_step(trainer)
    model = trainer.module
    theirs = LlamaRotaryEmbedding(AutoConfig.from_pretrained(trainer.config.model)).inv_freq  # transformers' float32
    loss, grads = gradient_bound.gradients(model, ids, gradient_bound.completion_loss(model, rows, targets),
                                           attention_mask=attn,
                                           freq_error=(theirs.double() - model.model.inv_freq.double()).abs())
    logits = decoder_bound.logits(model, ids, attn).map(lambda v: v.reshape(-1, v.shape[-1])[rows])
    logp = torch.log_softmax(logits.exact, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    error = logits.bound()
    entropy_error = entropy_bound(logp, 2 * error.max(-1, keepdim=True).values + log_softmax_bounds(logits.exact))
    top = logits.exact.topk(2, -1)
    decided = top.values[:, 0] - top.values[:, 1] > error.gather(1, top.indices).sum(-1)
    correct = top.indices[:, 0] == targets
    return dict(loss=loss, grads=grads, tokens=len(targets), entropy=(float(entropy.mean()), float(entropy_error.mean())),
                accuracy=(float(correct[decided].sum()) / len(targets), float((~decided).sum()) / len(targets)))


def assert_step_within(exact: dict, loss: float, grads: dict[str, torch.Tensor], metrics: dict | None = None) -> None:
    bound = float(exact["loss"].bound()) + gradient_bound.mean_rounding(float(exact["loss"].exact), exact["tokens"])
    assert abs(loss - float(exact["loss"].exact)) <= bound
    assert_grads_within(grads, exact["grads"])
    if metrics is not None:
        value, error = exact["entropy"]
        assert abs(metrics["entropy"] - value) <= error
        lowest, undecided = exact["accuracy"]  # the decided argmaxes count for sure; the others may
        assert lowest - 1e-12 <= metrics["mean_token_accuracy"] <= lowest + undecided + 1e-12


@pytest.mark.parametrize("split", [dict(per_device_train_batch_size=2, gradient_accumulation_steps=4),
                                   dict(per_device_train_batch_size=8, packing=True),
                                   dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                        gradient_checkpointing=True),
                                   dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, packing=True)])
def test_accumulated_gradient_equals_one_batch(tiny_train_model, tmp_path, one_batch, exact_step, split) -> None:
    """One batch and its splits (micro-batches, packing, checkpointing): each step's loss, gradients
    and metrics within float32's bounds of the exact ones, so within twice of each other."""
    _, loss, grads, metrics = one_batch
    trainer = sft_trainer(tiny_train_model, tmp_path, **split)
    loss2, grads2, metrics2 = step_grads(trainer)
    assert_step_within(exact_step, loss, grads, metrics)
    assert_step_within(exact_step, loss2, grads2, metrics2)
    assert metrics2["num_tokens"] == metrics["num_tokens"]


def test_step_loss_and_gradient_equal_transformers(tiny_train_model, one_batch, exact_step) -> None:
    """Reference: LlamaForCausalLM with labels -100 on prompt and padding (mean over the batch's
    completion tokens) on the same 8 rows, in the order our epoch stream served them."""
    from transformers import AutoModelForCausalLM

    trainer, loss, grads, _ = one_batch
    examples = [trainer.algorithm.examples[i] for i in first_step_indices(trainer)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_train_model), dtype=torch.float32)
    width = max(len(e.input_ids) for e in examples)
    pad = trainer.algorithm.pad_id
    ids = torch.tensor([e.input_ids + [pad] * (width - len(e.input_ids)) for e in examples])
    attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in examples])
    labels = torch.tensor([[-100] * len(e.prompt_ids) + e.completion_ids + [-100] * (width - len(e.input_ids))
                           for e in examples])
    out = hf(input_ids=ids, attention_mask=attn, labels=labels)
    out.loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert_step_within(exact_step, loss, grads)
    ours = exact_step["grads"]
    assert_step_within({**exact_step, "grads": {n: ours[n] for n in hf_grads}}, out.loss.item(), hf_grads)


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
