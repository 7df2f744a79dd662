"""Dithered float32 masters (train/dither.py): a bf16 value stays itself, and a master's small moves
reach its bf16 copy on average, which plain rounding of a bf16 checkpoint's weights never does."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.model.loader import load_model
from pagedrl.train.algorithms.grpo import GRPOConfig
from pagedrl.train.dither import bf16_neighbours, dither_masters, dither_offsets
from pagedrl.train.start import start_run


def _bf16_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.1
    x[:8] = torch.tensor([1.0, -1.0, 0.5, -0.25, 2.0**-20, -(2.0**-20), 0.0, 3.0])  # binade edges, zero
    return x.bfloat16().float()


def test_neighbours_are_the_adjacent_bf16_values() -> None:
    centre, up, down = bf16_neighbours(torch.tensor([1.0, -1.0, 0.1, 0.0]))
    assert centre.tolist()[:2] == [1.0, -1.0]
    assert up.tolist()[:2] == [2.0**-7, 2.0**-8]  # above 1.0 the step is 2^-7; above -1.0 it is 2^-8
    assert down.tolist()[:2] == [2.0**-8, 2.0**-7]
    assert (centre[2] + up[2]).bfloat16().float() == centre[2] + up[2]  # a bf16 value itself
    assert up[3] == down[3] == 0.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_a_bf16_value_rounds_to_itself_after_the_offset(seed: int) -> None:
    x = _bf16_values(4096, seed)
    u = dither_offsets(x, torch.Generator().manual_seed(seed))
    assert torch.equal((x + u).bfloat16().float(), x)
    _, up, down = bf16_neighbours(x)
    nonzero = x != 0
    assert bool(((u < up / 2) & (u > -down / 2))[nonzero].all())
    assert bool((u[~nonzero] == 0).all())
    assert bool((u[nonzero] != 0).float().mean() > 0.99)


def test_small_master_moves_reach_the_bf16_copy_on_average() -> None:
    """Every master moves a tenth of its bf16 step. Plain rounding of bf16 values keeps every copy
    where it was; after the offsets about a tenth of the copies move one whole step, so the copies
    move as the masters do on average (the standard error of this mean is 0.7%)."""
    x = _bf16_values(200_000, 0)
    x = x[x != 0]
    _, up, _ = bf16_neighbours(x)
    delta = up / 10
    plain = ((x + delta).bfloat16().float() - x).sum() / delta.sum()
    dithered_start = x + dither_offsets(x, torch.Generator().manual_seed(1))
    moved = ((dithered_start + delta).bfloat16().float() - dithered_start.bfloat16().float()).sum() / delta.sum()
    assert plain == 0.0
    assert abs(float(moved) - 1.0) < 0.05


def test_only_trainable_matrices_move_and_the_draw_is_seeded(tiny_train_model) -> None:
    def loaded():
        return load_model(tiny_train_model, device="cpu", dtype=torch.float32, load_tokenizer=False).model

    base, a, b, c = loaded(), loaded(), loaded(), loaded()
    for m in (a, b, c):
        m.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    dither_masters(a, seed=7)
    dither_masters(b, seed=7)
    dither_masters(c, seed=8)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    moved_any = False
    for name, p0 in base.named_parameters():
        if p0.dim() < 2 or name == "model.layers.0.mlp.down_proj.weight":
            assert torch.equal(pa[name], p0), name
            continue
        assert torch.equal(pa[name], pb[name]), name
        assert not torch.equal(pa[name], pc[name]), name
        _, up, down = bf16_neighbours(p0.detach())
        shift = (pa[name] - p0).detach()
        assert bool((shift.abs() <= torch.maximum(up, down) / 2).all()), name
        moved_any |= bool((shift != 0).any())
    assert moved_any


def test_start_run_dithers_bf16_runs_only(tiny_train_model, tmp_path) -> None:
    """bf16: the masters carry offsets (and a reference copied from them later computes the same
    numbers); float32 or bf16_dither=false: the loaded weights, untouched."""
    plain = load_model(tiny_train_model, device="cpu", dtype=torch.float32, load_tokenizer=False).model
    q = "model.layers.0.self_attn.q_proj.weight"
    runs = {}
    for label, fields in {"bf16": {"bf16": True}, "float32": {"bf16": False},
                          "undithered": {"bf16": True, "bf16_dither": False}}.items():
        config = GRPOConfig(model=str(tiny_train_model), output_dir=str(tmp_path / label), use_cpu=True, **fields)
        _, loaded = start_run(config, "this test needs")
        runs[label] = dict(loaded.model.named_parameters())[q].detach()
    p0 = dict(plain.named_parameters())[q].detach()
    assert not torch.equal(runs["bf16"], p0)
    assert torch.equal(runs["float32"], p0)
    assert torch.equal(runs["undithered"], p0)
