"""What a TRL SFTTrainer user writes in an SFT config, against TRL 1.16's own code: the `loss_type`
losses (TRL's `SFTTrainer.compute_loss` called unbound on a stand-in for the trainer whose model returns
the log-probs we choose, so what runs is TRL's code line for line), the first batch of a run against
TRL's own trainer, packing as TRL's `pack_dataset` and SFTTrainer pack, and the SFTConfig keys pagedrl
takes at TRL's value or refuses by name."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import yaml
from first_batches import TOLERANCE, ours_first_batch, theirs, trl_first_batch
from tiny_train import arithmetic_rows, sft_trainer
from trl import SFTConfig as TRLSFTConfig
from trl.trainer.sft_trainer import SFTTrainer

from pagedrl.train.algorithms.sft import SFT
from pagedrl.train.algorithms.sft_packing import PackedRow, pack_bfd
from pagedrl.train.config import load_config
from pagedrl.train.distributed import DistInfo
from pagedrl.train.examples import PromptCompletion
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


# -- packing -------------------------------------------------------------------------------------


def _examples(lengths: list[int], prompt: int = 2) -> list[PromptCompletion]:
    """Examples of the given lengths whose tokens say which example and position they are."""
    return [PromptCompletion([i * 1000 + t for t in range(min(prompt, n - 1))],
                             [i * 1000 + t for t in range(min(prompt, n - 1), n)], f"row {i}")
            for i, n in enumerate(lengths)]


def test_bfd_packing_equals_trl_pack_dataset() -> None:
    """TRL's `pack_dataset(..., "bfd")` on the same tokenized rows: the same rows, each holding the same
    examples in the same order; over 1000 examples, so that TRL's blocks of 1000 show, and with many equal
    lengths, so that its tie order does."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 65, (2345,), generator=g)]
    examples = _examples(lengths)
    rows = pack_bfd(examples, 64)
    theirs = pack_dataset(Dataset.from_dict({"input_ids": [e.input_ids for e in examples]}), 64, "bfd")
    assert len(rows) == len(theirs) < len(examples)
    for row, want in zip(rows, theirs, strict=True):
        assert [t for e in row.examples for t in e.input_ids] == want["input_ids"]
        assert [len(e.input_ids) for e in row.examples] == want["seq_lengths"]
        assert row.num_tokens <= 64


def test_packing_equals_trl_sft_trainer(tiny_train_model, tmp_path) -> None:
    """`packing: true` as TRL's SFTTrainer packs (bfd, its default): the dataset's rows (so the steps of an
    epoch), and the first batch of packed rows trained padding-free: loss and every gradient."""
    rows = arithmetic_rows(40)
    rows = [r for r in rows if isinstance(r["prompt"], str)]
    features, trl_loss, trl_grads, _ = trl_first_batch("sft", tiny_train_model, rows, tmp_path / "trl", size=2,
                                                       packing=True, max_length=48)
    trainer = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, packing=True, max_length=48,
                          per_device_train_batch_size=2)
    algorithm = trainer.algorithm
    trl_rows = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl-rows", packing=True, max_length=48)
    assert len(algorithm.examples) == len(trl_rows) < len(rows)
    for row, want in zip(algorithm.examples, trl_rows, strict=True):
        assert [t for e in row.examples for t in e.input_ids] == want["input_ids"]
        assert [len(e.input_ids) for e in row.examples] == want["seq_lengths"]
    for row, feature in zip(algorithm.examples[:2], features, strict=True):
        assert [t for e in row.examples for t in e.input_ids] == feature["input_ids"]
    _, loss, grads, _ = ours_first_batch(algorithm, size=2)
    assert abs(loss - trl_loss) < TOLERANCE
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name


def trl_prepared_rows(folder, rows: list[dict], out, **settings) -> list[dict]:
    """TRL 1.16's SFTTrainer's prepared (tokenized, packed) training rows."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    args = TRLSFTConfig(output_dir=str(out), bf16=False, use_cpu=True, report_to="none", **settings)
    made = SFTTrainer(model=theirs(folder), args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(str(folder)))
    return [made.train_dataset[i] for i in range(len(made.train_dataset))]


def test_shuffle_dataset_before_packing_as_trl(tiny_train_model, tmp_path) -> None:
    rows = [r for r in arithmetic_rows(40) if isinstance(r["prompt"], str)]
    trl_rows = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", packing=True, max_length=48,
                                 shuffle_dataset=True, seed=3)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, packing=True, max_length=48,
                            shuffle_dataset=True, seed=3).algorithm
    # TRL shuffles the packed rows once more, which every epoch's own order then replaces: compare as sets
    ours = sorted(tuple(t for e in row.examples for t in e.input_ids) for row in algorithm.examples)
    assert ours == sorted(tuple(r["input_ids"]) for r in trl_rows)


def test_eval_packing_follows_packing_unless_set(tiny_train_model, tmp_path) -> None:
    rows = arithmetic_rows(16)
    packed = sft_trainer(tiny_train_model, tmp_path / "a", rows=rows, packing=True, max_length=48).algorithm
    assert packed.eval_examples is None and isinstance(packed.examples[0], PackedRow)
    loaded = packed.model, packed.tokenizer
    for packing, eval_packing, want in [(True, None, PackedRow), (True, False, PromptCompletion),
                                        (False, True, PackedRow), (False, None, PromptCompletion)]:
        config = SFTConfig(model=str(tiny_train_model), output_dir=str(tmp_path / "b"), packing=packing,
                           eval_packing=eval_packing, max_length=48)
        algorithm = SFT(config, *loaded, DistInfo(), rows, rows)
        assert isinstance(algorithm.eval_examples[0], want), (packing, eval_packing)
        assert algorithm.evaluate(0)["loss"] > 0


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packing_without_max_length_is_refused_by_name(strategy) -> None:
    with pytest.raises(ValueError, match=r"packing: packing needs max_length"):
        load_config(SFTConfig, None, ["packing=true", f"packing_strategy={strategy}", "max_length=null"])


# -- the other keys ------------------------------------------------------------------------------


def test_every_trl_sft_config_key_at_its_default_is_taken() -> None:
    """Every field TRL 1.16's SFTConfig adds to the shared ones, at TRL's default, loads (as a TRL recipe
    written out in full carries them) and leaves pagedrl's defaults."""
    import dataclasses

    import trl
    from trl.trainer.base_config import _BaseConfig

    shared = {f.name for f in dataclasses.fields(_BaseConfig)}
    own = [f for f in dataclasses.fields(trl.SFTConfig) if f.name not in shared]
    assert len(own) > 20
    overrides = []
    for f in own:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        overrides.append(f"{f.name}={yaml.safe_dump(default, default_flow_style=True).splitlines()[0]}")
    assert load_config(SFTConfig, None, overrides) == SFTConfig()


@pytest.mark.parametrize(("override", "words"), [
    ("pad_to_multiple_of=8", "never the loss"),
    ("activation_offloading=true", "gradient_checkpointing"), ("dataset_kwargs={skip_prepare_dataset: true}",
                                                              "no skip_prepare_dataset"),
    ("model_init_kwargs={dtype: bfloat16}", "precision keys"), ("trust_remote_code=true", "no code"),
])
def test_trl_sft_keys_pagedrl_does_otherwise_are_refused_by_name(override, words) -> None:
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"^command line: {key}: only .*{words}"):
        load_config(SFTConfig, None, [override])
