"""`optim` as a TRL config names it: the values that are torch's AdamW (adamw_torch, and
adamw_torch_fused, transformers 5's default, its fused kernel) and plain SGD build what transformers'
Trainer builds for that name and update the weights bit for bit as it does; every other value is
refused listing these."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from pagedrl.train.config import TrainConfig, load_config
from pagedrl.train.offline_config import SFTConfig
from pagedrl.train.optim import build_optimizer, decay_groups

FIELDS = dict(learning_rate=1e-2, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, weight_decay=0.1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))


def train(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("name", ["adamw_torch", "adamw_torch_fused", "sgd"])
def test_each_accepted_optim_is_what_transformers_builds_for_it(tmp_path: Path, name: str) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), optim=name, use_cpu=True, report_to=[], **FIELDS)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model())
    theirs_model = model()
    theirs = cls(decay_groups(theirs_model, args.weight_decay), **kwargs)
    ours_model = model()
    ours, _ = build_optimizer(ours_model, TrainConfig(optim=name, **FIELDS), 0, 10)
    assert type(ours) is cls
    assert {k: ours.defaults[k] for k in kwargs if k != "lr"} == {k: v for k, v in kwargs.items() if k != "lr"}
    for a, b in zip(train(ours_model, ours), train(theirs_model, theirs), strict=True):
        assert torch.equal(a, b)


def test_the_fused_kernel_rounds_otherwise_than_the_plain_one() -> None:
    """Why adamw_torch_fused is not read as adamw_torch: on the CPU too its updates differ at the last bits."""
    plain, fused = model(), model()
    a = train(plain, build_optimizer(plain, TrainConfig(optim="adamw_torch", **FIELDS), 0, 10)[0], steps=20)
    b = train(fused, build_optimizer(fused, TrainConfig(optim="adamw_torch_fused", **FIELDS), 0, 10)[0], steps=20)
    assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["adafactor", "adamw_8bit", "adamw_torch_4bit", "lion_32bit", "adamw_apex_fused"])
def test_other_optimizers_are_refused_naming_the_accepted_ones(tmp_path: Path, name: str) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text(f"optim: {name}\n")
    with pytest.raises(ValueError, match=rf"optim: expected one of 'adamw_torch', 'adamw_torch_fused', 'sgd', "
                                         rf"got '{name}'"):
        load_config(SFTConfig, path)


def test_optim_args_is_refused_saying_what_optim_takes() -> None:
    with pytest.raises(ValueError, match=r"^command line: optim_args: only None \(pagedrl's behaviour\), got "
                                         r"'momentum=0.9': optim takes adamw_torch, adamw_torch_fused"):
        load_config(SFTConfig, None, ["optim_args=momentum=0.9"])
