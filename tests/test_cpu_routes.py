"""The engine's CPU kernels for the decoder's pieces in bf16 steps (`engine/cpu_routes.py`,
`model/routed.py`): each row-wise kernel against the decoder's own torch code and a float64
reference, the routing rules (what is taken, what passes through), and the engine's greedy tokens
and log-probs with the routes against a dense bf16 forward without them."""

from __future__ import annotations

import os
import platform

import pytest
import torch
from cpu_class import needs
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_cpu_kernels import needs_bf16_dot

from pagedrl.engine import cpu_routes
from pagedrl.kernels import ops, products
from pagedrl.model.decoder import MLP, RMSNorm
from pagedrl.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from pagedrl.model.routed import Linear, routed_to

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one

BF16_STEP = 2.0**-8  # a bf16 rounding is at most half a step of 2^-7 relative


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    """Built (or loaded) inside the test session's cache; the machine has a C++ compiler."""
    assert ops.available()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), dim=st.sampled_from([8, 64, 576, 100]), seed=st.integers(0, 2**16))
@example(rows=7, dim=64, seed=242).via("a normalized value on its neighbour")
@example(rows=7, dim=576, seed=55).via("the eager code too")
def test_rms_norm_is_the_decoders_with_its_roundings(rows, dim, seed) -> None:
    """float64 reference with the decoder's roundings (the normalized row to bf16, then times the
    weight to bf16): the scale is computed in float32 in another order, so a normalized value near a
    rounding boundary may land on its neighbour, one bf16 step away (up to 2^-7 relative), and the
    product's rounding adds half a step: within 3 x 2^-8 of the reference (seed 242 of a [7, 64] row
    and seed 55 of a [7, 576] one were 2.0 x 2^-8 off, for the eager code too)."""
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, 1e-5).bfloat16()
    norm.weight.data = (1 + 0.3 * torch.randn(dim, generator=gen)).bfloat16()
    x = (3 * torch.randn(rows, dim, generator=gen)).bfloat16()
    with torch.inference_mode():
        got = torch.ops.pagedrl_cpu.rms_norm(x, norm.weight, 1e-5)
        eager = norm(x)
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16().double()
    exact = norm.weight.double() * normed
    for out in (got, eager):
        assert ((out.double() - exact).abs() <= 3 * BF16_STEP * exact.abs() + 1e-30).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**16))
def test_silu_mul_rounds_silu_then_the_product(n, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate = (4 * torch.randn(n, generator=gen)).bfloat16()
    gate[:3] = torch.tensor([0.0, -90.0, 90.0])[: min(3, n)]
    up = torch.randn(n, generator=gen).bfloat16()
    got = torch.ops.pagedrl_cpu.silu_mul(gate, up)
    g = gate.double()
    silu = (g * torch.sigmoid(g)).bfloat16().double()  # rounded as F.silu's bf16 output is
    exact = silu * up.double()
    assert ((got.double() - exact).abs() <= 2 * BF16_STEP * exact.abs() + 1e-30).all()
    eager = torch.nn.functional.silu(gate) * up
    assert ((eager.double() - exact).abs() <= 2 * BF16_STEP * exact.abs() + 1e-30).all()


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_rotates_queries_and_keys_as_the_decoder_does(heads, head_dim) -> None:
    torch.manual_seed(0)
    tokens = 37
    positions = torch.randint(0, 5000, (1, tokens))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 10000.0, None), torch.bfloat16)
    q = torch.randn(1, tokens, heads[0], head_dim).bfloat16()
    k = torch.randn(1, tokens, heads[1], head_dim).bfloat16()
    got_q, got_k = torch.ops.pagedrl_cpu.rope(q, k, cos, sin)
    for x, got in ((q, got_q), (k, got_k)):
        exact = apply_rope(x.double(), cos.double(), sin.double())  # the same bf16 cos/sin, one rounding
        assert got.shape == x.shape
        assert ((got.double() - exact).abs() <= BF16_STEP * exact.abs() + 1e-30).all()
        eager = apply_rope(x, cos, sin)  # rounds each product and the sum
        torch.testing.assert_close(got.float(), eager.float(), rtol=2**-6, atol=2**-6)


def test_the_decoder_offers_its_pieces_and_falls_back(monkeypatch) -> None:
    """Inside `routed_to` each piece is offered to its route; a route's None means the torch code
    runs; outside, nothing is offered."""
    offered = []

    def decline(name):  # noqa: ANN001, ANN202
        def route(*args):  # noqa: ANN002, ANN202
            offered.append(name)
            return None
        return route

    from pagedrl.model.routed import Routes

    routes = Routes(linear=decline("linear"), rms_norm=decline("rms_norm"), silu_mul=decline("silu_mul"),
                    rope=decline("rope"))
    from pagedrl.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    mlp, norm = MLP(cfg), RMSNorm(32, 1e-5)
    x = torch.randn(2, 32)
    plain = mlp(norm(x))
    with routed_to(routes):
        routed = mlp(norm(x))
    assert torch.equal(plain, routed)
    assert offered == ["rms_norm", "linear", "linear", "silu_mul", "linear"]
    mlp(norm(x))
    assert len(offered) == 5


def test_decode_steps_route_small_bf16_products(monkeypatch) -> None:
    """Products of at most `max_rows()` rows, bf16, no gradient recorded: the kernel's result;
    anything else passes through to torch."""
    needs_bf16_dot()
    calls = []

    def counted(*args):  # noqa: ANN002
        calls.append(args[0].shape[0])
        return torch.ops.pagedrl_cpu.decode_linear(*args)

    monkeypatch.setattr(products, "kernel", counted)
    torch.manual_seed(0)
    layer = Linear(96, 40).bfloat16()
    most = products.max_rows()
    with torch.no_grad():
        for rows in (1, most, most + 1):
            x = torch.randn(1, rows, 96).bfloat16()
            with cpu_routes.routed_step(rows, on=True):
                got = layer(x)
            if rows <= most:
                assert torch.equal(got, torch.ops.pagedrl_cpu.decode_linear(x[0], layer.weight, layer.bias)[None])
            with cpu_routes.routed_step(rows, on=False):
                layer(x)
        assert calls == [1, most]
        with cpu_routes.routed_step(1, on=True):
            layer(torch.randn(1, 96).bfloat16())  # bf16, one row: taken
            layer.float()(torch.randn(1, 96))  # float32: passes through
    assert calls == [1, most, 1]
    layer.bfloat16()
    with cpu_routes.routed_step(1, on=True):  # bf16 with gradients recorded: passes through
        x = torch.randn(1, 96).bfloat16().requires_grad_()
        layer(x).sum().backward()
    assert x.grad is not None and len(calls) == 3


def test_packed_weights_give_torch_s_products_and_follow_weight_changes() -> None:
    """oneDNN's kernel on its packed copy: the same bits as `F.linear` at any row count; a bf16
    engine's own steps take the k-pairs kernel on its copy where it is built (else 1-2 rows the
    dot-product kernel); a weight written in place, or a cleared cache (the engine's weight-version
    bump), is packed again."""
    needs("avx512", "oneDNN's packed bf16 weights")
    torch.manual_seed(0)
    packed = products.PackedWeights()
    layer = Linear(96, 40).bfloat16()
    with torch.no_grad():
        for rows in (1, 3, 17, 64, 300):
            x = torch.randn(1, rows, 96).bfloat16()
            with cpu_routes.routed_step(rows, on=True, packed=packed, products_only=True):
                got = layer(x)
            assert torch.equal(got, torch.nn.functional.linear(x, layer.weight, layer.bias))
            with cpu_routes.routed_step(rows, on=True, packed=packed):
                engine = layer(x)
            if products.pairs_available():  # every row count on the k-pairs copy
                want = torch.ops.pagedrl_cpu.pair_linear(x[0], packed.packed(layer.weight, "pairs"), 40, layer.bias)
                assert torch.equal(engine, want[None])
            elif rows <= products.MAX_ROWS_OVER_PACKED and ops.decode_linear_available():
                assert torch.equal(engine, torch.ops.pagedrl_cpu.decode_linear(x[0], layer.weight, layer.bias)[None])
            else:
                assert torch.equal(engine, got)
        first = packed.packed(layer.weight)
        assert packed.packed(layer.weight) is first and packed.nbytes >= layer.weight.numel() * 2
        layer.weight.mul_(-1)  # an in-place update: its version counter moves
        x = torch.randn(4, 96).bfloat16()
        with cpu_routes.routed_step(4, on=True, packed=packed, products_only=True):
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        if products.pairs_available():  # the k-pairs copy follows the update too
            with cpu_routes.routed_step(4, on=True, packed=packed):
                exact = x.double() @ layer.weight.double().t() + layer.bias.double()
                assert (layer(x).double() - exact).abs().max() <= exact.abs().max() * 2.0**-7
        assert packed.packed(layer.weight) is not first
        again = packed.packed(layer.weight)
        packed.clear()
        assert packed.nbytes == 0 and packed.packed(layer.weight) is not again
        assert packed.linear(x.float(), layer.weight.float(), None) is None  # float32: torch's
        with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 rows under bf16 autocast: cast as it casts
            assert torch.equal(packed.linear(x.float(), layer.weight, layer.bias), layer(x.float()))
    del layer  # a weight that dies takes its packed copy with it
    assert packed.nbytes == 0


def test_routes_are_for_bf16_models_the_engine_owns() -> None:
    model = torch.nn.Linear(8, 8)
    assert not cpu_routes.usable(model, None)  # float32
    assert not cpu_routes.usable(model, torch.bfloat16)  # a trainer's autocast rollouts
    assert not cpu_routes.usable(model.bfloat16(), torch.bfloat16)
    assert cpu_routes.usable(model, None) == ops.available()


def test_glibc_keeps_freed_memory_unless_told_not_to(monkeypatch) -> None:
    """On glibc the settings are accepted; `PAGEDRL_KEEP_FREED=0` leaves the defaults."""
    from pagedrl.kernels import memory as cpu_memory

    cpu_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("PAGEDRL_KEEP_FREED", "0")
    assert not cpu_memory.keep_freed_memory()
    cpu_memory.keep_freed_memory.cache_clear()
    monkeypatch.delenv("PAGEDRL_KEEP_FREED")
    assert cpu_memory.keep_freed_memory() == (platform.libc_ver()[0] == "glibc")


KEPT_MEMORY_PROBE = """
import resource, sys, torch
from pagedrl.kernels.memory import keep_freed_memory
keep = sys.argv[1] == "keep"
assert keep_freed_memory(every_block=True) == keep  # as a trainer sets it
def faults(n):  # page faults while writing a fresh n-float tensor
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(n).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults(16 << 20)  # 64 MB, freed at once
again = faults(8 << 20) + faults(4 << 20)  # 32 and 16 MB: kept, they come from the freed 64
heap = [line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
start, end = (int(x, 16) for x in heap[0].split()[0].split("-")) if heap else (0, 0)
block = torch.empty(16 << 20)
from pagedrl.kernels import ops  # a trainer's large blocks live in its pool, where the kernels are built
pooled = keep and ops.block_pool_stats().get("in_use", 0) >= block.nbytes
print(start <= block.data_ptr() < end or pooled, again)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_freed_blocks_of_any_size_are_served_again_from_the_heap() -> None:
    """With a trainer's settings, a 64 MB block comes from the heap (or the large-block pool), and once freed its pages serve
    the next requests of other sizes without a page fault; without them, glibc maps each such block
    afresh and unmaps it on free, so the same writes fault on every page."""
    import subprocess
    import sys

    assert ops.available()  # built here, into the suite's cache, before the probes load them
    out = {}
    for mode in ("keep", "default"):
        env = {**os.environ, "PAGEDRL_KEEP_FREED": "1" if mode == "keep" else "0"}
        result = subprocess.run([sys.executable, "-c", KEPT_MEMORY_PROBE, mode], env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        in_heap, faults = result.stdout.split()
        out[mode] = (in_heap == "True", int(faults))
    assert out["keep"][0] and out["keep"][1] < 100
    assert not out["default"][0] and out["default"][1] > 4000  # 48 MB written: 12 k pages
