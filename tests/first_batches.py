"""The first SFT and DPO batches of a saved tiny folder against transformers' own class on the same weights:
the loss, and every parameter's gradient under the same name, within 1e-5 (the families' reference tests);
and TRL's own SFTTrainer and DPOTrainer on a first batch, for what only the trainers add (the router's
load-balancing loss of a mixture of experts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from preference_data import dpo_trainer, preference_rows
from tiny_train import sft_trainer

from pagedrl.model.checkpoint import load_causal_lm

TOLERANCE = 1e-5


def theirs(folder: str | Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


def answer_logp(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Σ log p(answer token | everything before it) from transformers' forward of one unpadded row."""
    ids = torch.tensor([prompt + answer])
    logp = F.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(1, torch.tensor(answer)[:, None]).sum()


def assert_gradients_equal(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    """Parameter by parameter under the same names (fused and stacked ones included), each one there, not
    zero, and within TOLERANCE of transformers'."""
    grads = dict(hf.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if name in grads:
            assert p.grad is not None and grads[name].grad is not None, name
            assert float((p.grad - grads[name].grad).abs().max()) < TOLERANCE, name
            assert float(p.grad.abs().max()) > 1e-4, name  # a gradient that is there to compare
            compared += 1
    assert compared == len(grads)


def assert_first_sft_batch_equals_transformers(folder: str | Path, out: Path, **sft: object) -> None:
    """The mean negative log-likelihood of the completion tokens of a right-padded batch of four rows."""
    hf = theirs(folder)
    algorithm = sft_trainer(folder, out, **sft).algorithm
    assert_first_sft_batch_equals(algorithm, hf)
    assert_gradients_equal(algorithm.model, hf)


def assert_first_sft_batch_equals_peft(folder: str | Path, out: Path, **sft: object) -> None:
    """The same with `use_peft` (and `sft`'s lora fields): the adapter, its B drawn, saved and loaded by
    peft on transformers' model; the loss and each adapter tensor's gradient under PEFT's name."""
    import peft
    from tiny import randomise_adapter

    from pagedrl.model.adapter import PEFT_PREFIX, save_adapter
    from pagedrl.model.expert_lora import peft_names
    from pagedrl.train.adapters import attach_lora

    trainer = sft_trainer(folder, out, use_peft=True, **sft)
    algorithm = trainer.algorithm
    attach_lora(trainer.config, algorithm.model)  # as a run attaches them (train/trainer.py)
    randomise_adapter(algorithm.model)
    save_adapter(algorithm.model, out / "adapter")
    hf = peft.PeftModel.from_pretrained(theirs(folder), out / "adapter", is_trainable=True).train()
    assert_first_sft_batch_equals(algorithm, hf)
    renamed = peft_names(algorithm.model)
    grads = {PEFT_PREFIX + renamed.get(n, n).replace(".weight", ".default.weight"): p
             for n, p in algorithm.model.named_parameters() if p.requires_grad}
    theirs_grads = {n: p for n, p in hf.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(theirs_grads)
    for name, p in grads.items():
        assert float((p.grad - theirs_grads[name].grad).abs().max()) < TOLERANCE, name
        assert float(p.grad.abs().max()) > 1e-4, name


def assert_first_sft_batch_equals(algorithm, hf: torch.nn.Module) -> None:
    """The loss of `algorithm`'s first four rows against `hf`'s, both backpropagated."""
    examples = algorithm.examples[:4]
    batch = algorithm.collate(examples)
    model = algorithm.model.train()
    loss, _ = algorithm.loss(model, batch, torch.tensor(float(batch.targets.numel())))
    loss.backward()
    mask = torch.tensor([[1] * len(e.input_ids) + [0] * (batch.input_ids.shape[1] - len(e.input_ids))
                         for e in examples])
    logits = hf(input_ids=batch.input_ids, attention_mask=mask).logits
    rows = logits.reshape(-1, logits.shape[-1])[batch.predict_at]
    ref = -torch.log_softmax(rows, -1).gather(-1, batch.targets[:, None]).mean()
    ref.backward()
    assert abs(loss.item() - ref.item()) < TOLERANCE


def assert_first_dpo_batch_equals_transformers(folder: str | Path, reference: str | Path, out: Path,
                                               beta: float = 0.3, longer_than: int = 0, **dpo: object) -> None:
    """DPO's sigmoid loss of four pairs against a different reference model: -log σ(β (policy margin -
    reference margin)), each answer scored on prompt + answer alone; not log 2, so the reference counts.
    `longer_than`: some pair's prompt and chosen answer are longer (a window of half that is crossed);
    `dpo`: more DPOConfig fields (a mixture of experts: `router_aux_loss_coef=0`, the router's loss being
    the trainers' addition, checked against TRL's in `test_moe_trl.py`)."""
    trainer = dpo_trainer(folder, out, preference_rows(8, seed=3), beta=beta, per_device_train_batch_size=4,
                          reference=load_causal_lm(reference, dtype=torch.float32), **dpo)
    algorithm = trainer.algorithm
    examples = algorithm.examples[:4]
    pairs = [getattr(e, "pair", e) for e in examples]
    assert max(len(p.prompt_ids) + len(p.chosen_ids) for p in pairs) > longer_than
    model = algorithm.model.train()
    batch = algorithm.collate(examples)
    loss, _ = algorithm.loss(model, batch, torch.tensor(algorithm.count(batch)))
    loss.backward()
    policy, frozen = theirs(folder), theirs(reference)

    def margin(m: torch.nn.Module, p) -> torch.Tensor:
        return answer_logp(m, p.prompt_ids, p.chosen_ids) - answer_logp(m, p.prompt_ids, p.rejected_ids)

    with torch.no_grad():
        reference_margins = torch.stack([margin(frozen, p) for p in pairs])
    ref = -F.logsigmoid(beta * (torch.stack([margin(policy, p) for p in pairs]) - reference_margins)).mean()
    ref.backward()
    assert algorithm.config.loss_type in ("sigmoid", ["sigmoid"])
    assert abs(loss.item() - ref.item()) < TOLERANCE
    assert abs(loss.item() - float(torch.log(torch.tensor(2.0)))) > 1e-4  # the reference differs from the policy
    assert_gradients_equal(model, policy)


def trl_first_batch(kind: str, folder: str | Path, rows: list[dict], out: Path, size: int = 4,
                    **settings: object) -> tuple[list[dict], float, dict[str, torch.Tensor], dict[str, float]]:
    """TRL 1.16's own SFTTrainer, DPOTrainer or KTOTrainer (`kind`) on the first `size` rows of `rows` as one micro-batch
    of a one-micro-batch step: its tokenized rows, loss, every parameter's gradient and its metrics."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

    config, trainer_class = {"sft": (SFTConfig, SFTTrainer), "dpo": (DPOConfig, DPOTrainer),
                             "kto": (KTOConfig, KTOTrainer)}[kind]
    args = config(output_dir=str(out), per_device_train_batch_size=size, bf16=False, use_cpu=True, report_to="none",
                  **{"max_length": None, "seed": 0, **settings})
    trainer = trainer_class(model=theirs(folder), args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(str(folder)))
    features = [trainer.train_dataset[i] for i in range(size)]
    batch = trainer.data_collator(features)
    trainer.model.train()
    if kind == "sft":  # as its loop calls it: the step's label tokens given, one micro-batch a step
        trainer.current_gradient_accumulation_steps = 1
        loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=(batch["labels"][:, 1:] != -100).sum())
    else:
        loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    return features, float(loss.detach()), grads, {k: v[0] for k, v in trainer._metrics["train"].items()}


def ours_first_batch(algorithm: Any, size: int = 4) -> tuple[list[object], float, dict[str, torch.Tensor],
                                                                 dict[str, float]]:
    """pagedrl's SFT, DPO or KTO algorithm on its first `size` examples as one micro-batch of a one-micro-batch
    step: the examples, the loss, every parameter's gradient and the metrics."""
    examples = algorithm.examples[:size]
    batch = algorithm.collate(examples)
    model = algorithm.model.train()
    loss, metrics = algorithm.loss(model, batch, torch.tensor(algorithm.count(batch)))
    loss.backward()
    values = {k: float(m.total) / float(m.weight) for k, m in metrics.items() if m.reduce == "mean"}
    return examples, float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, values
