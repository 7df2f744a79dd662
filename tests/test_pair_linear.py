"""The k-pairs product of a bf16 engine's projections (`kernels/csrc/pair_linear.cpp`): every output the
float32 sum of its products rounded once (against float64), a row's outputs alike in any batch, the
layout's edges (features past a panel of 32, rows past a tile of 12, a block of 96) and its errors."""

from __future__ import annotations

import pytest
import torch
from cpu_class import needs_not
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_kernels import assert_float32_sum_rounded_once, needs_bf16_dot

from pagedrl.kernels import ops

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


def pair_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    ops = torch.ops.pagedrl_cpu
    return ops.pair_linear(x, ops.pack_pairs(weight), weight.shape[0], bias)


@settings(max_examples=40, deadline=None)
@given(rows=st.one_of(st.integers(1, 40), st.sampled_from([95, 96, 97, 200])), out_features=st.integers(1, 100),
       pairs=st.one_of(st.integers(1, 100), st.sampled_from([288, 768])), bias=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_pair_linear_is_the_float32_sum_rounded_once(rows, out_features, pairs, bias, strided, seed) -> None:
    """Within half a bf16 step of the exact (float64) value plus float32's accumulation error, for any
    row count (tiles of 12 and their tail, blocks of 96), any feature count (panels of 32 and a
    partial last one), input rows strided (a slice of a wider tensor)."""
    needs_bf16_dot()
    gen = torch.Generator().manual_seed(seed)
    in_features = 2 * pairs
    wide = torch.randn(rows, in_features + (6 if strided else 0), generator=gen).bfloat16()
    x = wide[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    assert_float32_sum_rounded_once(pair_linear(x, weight, b), x, weight, b)


def test_pair_linear_computes_a_row_alike_in_any_batch() -> None:
    """A row's outputs do not depend on the rows beside it: alone, among 32, among 600 (blocks of
    96 rows, panels walked either way round), or on one thread instead of two."""
    needs_bf16_dot()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 576, generator=gen).bfloat16()
    weight = torch.randn(1000, 576, generator=gen).bfloat16()
    whole = pair_linear(x, weight, None)
    by_32 = torch.cat([pair_linear(x[i:i + 32], weight, None) for i in range(0, 600, 32)])
    assert torch.equal(whole, by_32)
    for row in (0, 95, 96, 599):
        assert torch.equal(whole[row:row + 1], pair_linear(x[row:row + 1], weight, None))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # the suite's workers run one thread: both settings, whatever the ambient one
            torch.set_num_threads(n)
            assert torch.equal(whole, pair_linear(x, weight, None))
    finally:
        torch.set_num_threads(threads)


def test_pair_linear_names_what_does_not_fit() -> None:
    needs_bf16_dot()
    ops = torch.ops.pagedrl_cpu
    packed = ops.pack_pairs(torch.randn(40, 64).bfloat16())
    assert packed.shape == (2, 32, 32, 2)
    with pytest.raises(RuntimeError, match="does not fit a packed weight"):
        ops.pair_linear(torch.randn(3, 66).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not fit a packed weight"):
        ops.pair_linear(torch.randn(3, 64).bfloat16(), packed, 70, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.pair_linear(torch.randn(3, 64).bfloat16(), packed, 40, torch.randn(41).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        ops.pair_linear(torch.randn(3, 64), packed, 40, None)


def test_gate_up_is_the_products_and_silu_mul_apart() -> None:
    """An MLP's silu(x @ gate.T) * (x @ up.T) in one pass: the same bits as the two k-pairs products and
    `silu_mul`, at tile edges (6 rows a tile) and a partial block; a gate or up weight written in
    place is packed again; shapes it does not take (features not a multiple of 32, gradients
    recorded) are left to the decoder's own code."""
    needs_bf16_dot()
    from pagedrl.kernels import products

    needs_not("amx", "the k-pairs route")
    assert products.pairs_available()
    ops = torch.ops.pagedrl_cpu
    packed = products.PackedWeights()
    gen = torch.Generator().manual_seed(5)
    gate = (torch.randn(96, 64, generator=gen) / 8).bfloat16()
    up = torch.randn(96, 64, generator=gen).bfloat16()
    with torch.no_grad():
        for rows in (1, 5, 6, 7, 100, 203):
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            apart = ops.silu_mul(pair_linear(x, gate, None), pair_linear(x, up, None))
            assert torch.equal(packed.gate_up(x, gate, up), apart)
        up.mul_(-1)
        assert torch.equal(packed.gate_up(x, gate, up), ops.silu_mul(pair_linear(x, gate, None), pair_linear(x, up, None)))
        assert packed.gate_up(x, gate[:40], up[:40]) is None
    assert packed.gate_up(x, gate, up) is None  # gradients recorded: the decoder's code


def test_the_mlp_takes_the_fused_route_only_for_plain_projections() -> None:
    """A bf16 engine's MLP step: one fused call where gate and up are plain projections without bias,
    with the result of the unfused step; an adapter's layer (LoRA) keeps its own forward."""
    needs_bf16_dot()
    from pagedrl.engine import cpu_routes
    from pagedrl.kernels import products
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import MLP
    from pagedrl.model.lora import LoRALinear

    needs_not("amx", "the k-pairs route")
    assert products.pairs_available()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    mlp = MLP(cfg).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    packed = products.PackedWeights()
    calls = []
    fused = packed.gate_up
    packed.gate_up = lambda *a: calls.append(1) or fused(*a)  # what the engine's routes call
    with torch.no_grad():
        with cpu_routes.routed_step(3, on=True, packed=packed):
            got = mlp(x)
        assert calls == [1]
        ops = torch.ops.pagedrl_cpu
        hidden = ops.silu_mul(pair_linear(x, mlp.gate_proj.weight, None), pair_linear(x, mlp.up_proj.weight, None))
        assert torch.equal(got, pair_linear(hidden, mlp.down_proj.weight, None))
        mlp.gate_proj = LoRALinear(mlp.gate_proj, 4, 8.0, 0.0, torch.Generator().manual_seed(1)).bfloat16()
        torch.nn.init.normal_(mlp.gate_proj.lora_B.weight)
        with cpu_routes.routed_step(3, on=True, packed=packed):
            adapted = mlp(x)
        assert calls == [1] and not torch.equal(adapted, got)
