"""The mixture-of-experts pieces against transformers: the sparse block (routing, grouped experts,
gradients), the checkpoint layout both ways, the config fields and what is refused, and the router's
load-balancing loss. The whole models are checked in the family-parametrized reference tests."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny import FAMILIES, MOE_FAMILIES, hf_model, ours_from

from pagedrl.model.checkpoint import CheckpointError, load_causal_lm, load_weights, save_checkpoint
from pagedrl.model.config import ConfigError, ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.moe import SparseMoeBlock, collect_router_logits
from pagedrl.train.router_loss import load_balancing_loss


def saved_names(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_block_and_its_gradients_equal_transformers(family: str) -> None:
    """Outputs within float32 rounding of transformers' block on 40 rows (every expert used), and the
    gradients of the router and of every expert's weights too."""
    hf = hf_model(FAMILIES[family])
    ours = ours_from(hf)
    theirs, mine = hf.model.layers[0].mlp, ours.model.layers[0].mlp
    assert isinstance(mine, SparseMoeBlock)
    x = torch.randn(2, 20, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ref, got = theirs(x.clone()), mine(x.clone())
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    _, chosen, _ = mine.route(x.reshape(-1, x.shape[-1]))
    assert chosen.unique().numel() == 8  # all experts take rows
    probe = torch.randn_like(ref)
    (ref * probe).sum().backward()
    (got * probe).sum().backward()
    for name, p in mine.named_parameters():
        torch.testing.assert_close(p.grad, theirs.get_parameter(name).grad, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_checkpoints_hold_one_tensor_per_expert_as_transformers_writes_them(tmp_path, family: str) -> None:
    """pagedrl writes the very tensor names transformers' `save_pretrained` writes (per expert; Mixtral
    under `block_sparse_moe` with w1/w2/w3), with the same values."""
    hf = hf_model(FAMILIES[family])
    hf.save_pretrained(tmp_path / "hf")
    save_checkpoint(ours_from(hf), tmp_path / "ours")
    names = saved_names(tmp_path / "ours")
    assert names == saved_names(tmp_path / "hf")
    expert = ("model.layers.0.block_sparse_moe.experts.7.w3.weight" if family == "mixtral"
              else "model.layers.0.mlp.experts.7.up_proj.weight")
    assert expert in names
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as b:
        for name in names:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_a_state_dict_in_transformers_in_memory_layout_loads_too() -> None:
    """Stacked expert tensors (`experts.gate_up_proj`, as a transformers model holds them) pass through."""
    hf = hf_model(FAMILIES["mixtral"])
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(model, dict(hf.state_dict()), "memory")
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)


def test_a_missing_expert_is_named(tmp_path) -> None:
    hf = hf_model(FAMILIES["qwen3-moe"])
    save_checkpoint(ours_from(hf), tmp_path / "m")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    del state["model.layers.0.mlp.experts.5.down_proj.weight"]
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.0\.mlp\.experts\.5\.down_proj\.weight"):
        load_causal_lm(tmp_path / "m", dtype=torch.float32)


def test_config_fields_round_trip_and_what_is_refused() -> None:
    raw = dict(FAMILIES["qwen3-moe"], decoder_sparse_step=2, norm_topk_prob=True, router_aux_loss_coef=0.01,
               output_router_logits=True)
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.sparse_layer(i) for i in range(4)] == [False, False, False, True]  # layer 1 is mlp-only
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert dataclasses.replace(again, extra=cfg.extra) == cfg  # (`dtype` comes back among the extras)
    assert transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_dict().items() if k != "architectures"}
                                             ).moe_intermediate_size == 32
    mixtral = ModelConfig.from_dict(FAMILIES["mixtral"])
    assert mixtral.expert_intermediate_size == mixtral.intermediate_size and mixtral.norm_topk_prob
    with pytest.raises(ConfigError, match="'router_jitter_noise'"):
        ModelConfig.from_dict(dict(FAMILIES["mixtral"], router_jitter_noise=0.1))
    with pytest.raises(ConfigError, match="'num_experts_per_tok'"):
        ModelConfig.from_dict(dict(FAMILIES["mixtral"], num_experts_per_tok=9))
    with pytest.raises(ConfigError, match="'mlp_only_layers'"):
        ModelConfig.from_dict(dict(FAMILIES["qwen3-moe"], mlp_only_layers="1"))


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked: bool) -> None:
    """Over two layers' router logits, with and without padding, the value and its gradient."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(3 * 7, 8, generator=g, requires_grad=True) for _ in range(2)]
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, :2] = 0
    ref = load_balancing_loss_func(tuple(logits), 8, 2, mask if masked else None)
    got = load_balancing_loss(logits, 8, 2, mask.bool() if masked else None)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    ref_grads = torch.autograd.grad(ref, logits)
    for a, b in zip(torch.autograd.grad(got, logits), ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_the_loss_in_float64_by_hand() -> None:
    """E · Σ_e f_e P_e with f_e the share of the k choices that went to e and P_e its mean probability."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]], dtype=torch.float64)
    probs = logits.softmax(-1)
    f = torch.tensor([1.0, 1.0, 0.0]) / 2  # top-1: expert 0, then expert 1
    expected = 3 * (f * probs.mean(0)).sum()
    assert load_balancing_loss([logits], 3, 1).item() == pytest.approx(expected.item(), abs=1e-6)


def test_router_logits_are_collected_once_per_sparse_layer() -> None:
    model = ours_from(hf_model(FAMILIES["qwen3-moe"]))  # layer 1 is dense
    with collect_router_logits() as logits:
        model(torch.tensor([[5, 6, 7]]))
    assert len(logits) == 1 and logits[0].shape == (3, 8)
    model(torch.tensor([[5, 6, 7]]))  # outside the block nothing is recorded
    assert len(logits) == 1


def test_lora_on_the_feed_forward_of_a_mixture_of_experts_is_refused() -> None:
    """PEFT maps those names onto the experts' stacked weights, which pagedrl's LoRA does not adapt."""
    from pagedrl.model.lora import LoRAConfig, apply_lora

    for targets in (["all-linear"], ["q_proj", "down_proj"]):
        with pytest.raises(ValueError, match=r"mixture of experts.*attention projections"):
            apply_lora(ours_from(hf_model(FAMILIES["qwen3-moe"])), LoRAConfig(r=2, target_modules=targets))


def test_an_autocast_engine_holds_bf16_copies_of_the_experts() -> None:
    """A trainer's rollout engine (bf16 autocast over float32 masters) casts the stacked expert weights
    once per weight change, as it casts projections: the same numbers as autocast on the masters."""
    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams

    model = ours_from(hf_model(FAMILIES["mixtral"]))
    llm = LLM.from_module(model, kv_cache_tokens=256, autocast_dtype=torch.bfloat16)
    cast = llm.engine.runner.cast
    assert cast is not None
    experts, masters = cast.twin.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16 and masters.gate_up_proj.dtype == torch.float32
    ids = torch.randint(3, 211, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(cast.twin.logits(cast.twin(ids)), model.logits(model(ids)))
    with torch.no_grad():
        masters.down_proj.mul_(2)
    llm.bump_weight_version()
    llm.generate([ids[0].tolist()], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert cast.num_refreshes == 1 and torch.equal(experts.down_proj, masters.down_proj.bfloat16())


def exact_experts(rows: torch.Tensor, counts: list[int], experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's SwiGLU of its rows in float64, and the magnitudes of its output sums."""
    x, gate_up, down = rows.double(), experts.gate_up_proj.double(), experts.down_proj.double()
    exact, magnitude, start = [], [], 0
    for e, count in enumerate(counts):
        gate, up = (x[start:start + count] @ gate_up[e].T).chunk(2, -1)
        hidden = torch.nn.functional.silu(gate) * up
        exact.append(hidden @ down[e].T)
        magnitude.append(hidden.abs() @ down[e].abs().T)
        start += count
    return torch.cat(exact), torch.cat(magnitude)


@pytest.mark.isa
def test_a_float32_engines_expert_products_on_the_kernel() -> None:
    """`Routes.experts` of a float32 engine (the float32 kernels by an expert's rows, MKL above):
    within float32 rounding of the exact outputs (sums of 96 terms: ~1e-6 of their magnitudes), as
    torch's products are."""
    from pagedrl.kernels import ops
    from pagedrl.kernels.products import float_experts
    from pagedrl.model.moe import Experts

    assert ops.available()
    torch.manual_seed(1)
    experts = Experts(8, 64, 96)
    counts = [5, 0, 7, 3, 40, 5, 6, 1]
    rows = torch.randn(sum(counts), 64)
    with torch.inference_mode():
        got, ref = float_experts(rows, counts, experts.gate_up_proj, experts.down_proj), experts.grouped(rows, counts)
    exact, magnitude = exact_experts(rows, counts, experts)
    for out in (got, ref):
        assert ((out.double() - exact).abs() <= 1e-5 * magnitude).all()


@pytest.mark.isa
def test_a_bf16_engines_expert_products_on_the_kernels() -> None:
    """`Routes.experts` of a bf16 engine (the k-pairs kernels, gate and up in one pass): each expert's
    output within bf16 rounding of the exact one, as torch's bf16 products are (the hidden values
    rounded once, the sums in float32, the outputs rounded once: a few units of 2^-8 of the terms'
    magnitudes); experts without rows are skipped."""
    from cpu_class import needs, needs_not

    from pagedrl.kernels.products import PackedWeights
    from pagedrl.model.moe import Experts

    needs("avx512_bf16", "the k-pairs kernels")
    needs_not("amx", "the k-pairs kernels")
    torch.manual_seed(0)
    experts = Experts(8, 64, 96).bfloat16()
    counts = [5, 0, 7, 3, 33, 5, 6, 1]
    rows = torch.randn(sum(counts), 64).bfloat16()
    with torch.inference_mode():
        got, ref = PackedWeights().experts(rows, counts, experts.gate_up_proj, experts.down_proj), \
            experts.grouped(rows, counts)
    exact, magnitude = exact_experts(rows, counts, experts)
    for out in (got, ref):
        assert out.shape == exact.shape
        assert ((out.double() - exact).abs() <= 4 * 2**-8 * magnitude).all()
