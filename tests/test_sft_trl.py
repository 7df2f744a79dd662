"""What a TRL SFTTrainer user writes in an SFT config, against TRL 1.16's own code: the `loss_type`
losses (TRL's `SFTTrainer.compute_loss` called unbound on a stand-in for the trainer whose model returns
the log-probs we choose, so what runs is TRL's code line for line), the first batch of a run against
TRL's own trainer, and the SFTConfig keys pagedrl takes at TRL's value or refuses by name."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from first_batches import TOLERANCE, ours_first_batch, trl_first_batch
from tiny_train import arithmetic_rows, sft_trainer
from trl.trainer.sft_trainer import SFTTrainer

from pagedrl.train.config import load_config
from pagedrl.train.losses import dft_loss, sft_loss
from pagedrl.train.offline_config import SFTConfig


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1
    parallelism_config = None

    @staticmethod
    def gather_for_metrics(t: torch.Tensor) -> torch.Tensor:
        return t


def _batch(rows: int = 4, seq_len: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A label mask over the shifted positions (each row's labels a run that ends before its padding) and
    per-token log-probs of the labels, 0 where there is none, as TRL's fused head returns them."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq_len - 1, dtype=torch.bool)
    for r in range(rows):
        start = int(torch.randint(0, 4, (1,), generator=g))
        mask[r, start:int(torch.randint(start + 1, seq_len, (1,), generator=g))] = True
    return mask, -torch.rand(rows, seq_len - 1, generator=g, dtype=torch.float64) * 4 * mask


def _trl_sft(loss_type: str, mask: torch.Tensor, token_logps: torch.Tensor, num_items: int | None):
    """TRL's SFT loss and its gradient in the per-token log-probs."""
    rows, shifted = mask.shape
    token_logps = token_logps.clone().requires_grad_(True)
    outputs = SimpleNamespace(log_probs=token_logps, label_mask=mask, entropy=torch.zeros(rows, shifted),
                              is_top1=torch.zeros(rows, shifted, dtype=torch.bool))
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
                              compute_loss_func=None, label_smoother=None, _metrics=defaultdict(lambda: defaultdict(list)),
                              _total_train_tokens=0, _tp_size=1, get_tp_size=lambda: 1,
                              args=SimpleNamespace(loss_type=loss_type, average_tokens_across_devices=True))
    inputs = {"input_ids": torch.zeros(rows, shifted + 1, dtype=torch.long),
              "attention_mask": torch.ones(rows, shifted + 1, dtype=torch.long)}
    loss = SFTTrainer.compute_loss(trainer, lambda **kw: outputs, inputs,
                                   num_items_in_batch=None if num_items is None else torch.tensor(num_items))
    (grad,) = torch.autograd.grad(loss, token_logps)
    return loss.detach(), grad


@pytest.mark.parametrize("num_items", [None, 50])
@pytest.mark.parametrize(("loss_type", "ours"), [("nll", sft_loss), ("dft", dft_loss)])
def test_sft_losses_equal_trl_sft_trainer_in_float64(loss_type, ours, num_items) -> None:
    """The loss and its gradient equal TRL's to 1e-12 in float64 (a sum of a few dozen terms of order 1),
    over the micro-batch's label tokens or the step's (`num_items_in_batch`)."""
    for seed in range(3):
        mask, token_logps = _batch(seed=seed)
        trl_loss, trl_grad = _trl_sft(loss_type, mask, token_logps, num_items)
        logps = token_logps.clone().requires_grad_(True)
        loss = ours(logps, mask, num_items_in_batch=num_items)
        (grad,) = torch.autograd.grad(loss, logps)
        torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
        # TRL's log-probs outside the labels are 0 and summed all the same: their gradient means nothing
        torch.testing.assert_close(grad, trl_grad * mask, rtol=1e-12, atol=1e-12)
    if loss_type == "dft":  # the weight p changes the loss: the comparison is not nll's twice
        assert abs(float(loss) - float(sft_loss(token_logps, mask, num_items_in_batch=num_items))) > 0.1


def test_dft_first_batch_equals_trl_sft_trainer(tiny_train_model, tmp_path) -> None:
    """`loss_type: dft` in a run: the first batch's loss and every gradient as TRL's SFTTrainer's."""
    rows = [r for r in arithmetic_rows() if isinstance(r["prompt"], str)]
    features, trl_loss, trl_grads, _ = trl_first_batch("sft", tiny_train_model, rows, tmp_path / "trl", loss_type="dft")
    trainer = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, loss_type="dft")
    examples, loss, grads, _ = ours_first_batch(trainer.algorithm)
    assert [e.input_ids for e in examples] == [f["input_ids"] for f in features]
    assert abs(loss - trl_loss) < TOLERANCE
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name
    nll = sft_trainer(tiny_train_model, tmp_path / "nll", rows=rows)
    assert abs(ours_first_batch(nll.algorithm)[1] - loss) > 0.1  # dft is not nll on this batch


def test_loss_type_is_nll_by_default_and_read_in_trl_form(tmp_path) -> None:
    assert SFTConfig().loss_type == "nll"
    path = tmp_path / "sft.yaml"
    path.write_text("loss_type: [dft]\n")
    assert load_config(SFTConfig, path).loss_type == "dft"
    with pytest.raises(ValueError, match=r"loss_type: expected one of 'nll', 'dft'"):
        load_config(SFTConfig, None, ["loss_type=sigmoid"])
