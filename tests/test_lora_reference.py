"""LoRA against PEFT on the same weights: logits with an adapter, adapters saved by either side
loaded by the other, a merged checkpoint against the live adapter, and the engine's greedy tokens
with a live adapter against those of the merged checkpoint."""

from __future__ import annotations

import json

import decoder_bound
import peft
import pytest
import torch
import transformers
from float_bounds import gamma
from tiny import FAMILIES, freq_error, hf_model, randomise_adapter

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_adapter,
    read_adapter_config,
    save_adapter,
)
from pagedrl.model.checkpoint import CheckpointError, load_causal_lm, save_checkpoint
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.lora import LoRAConfig, apply_lora, disable_adapter, lora_layers, merge_lora


def padded_batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 20), generator=g)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 14:] = 0
    return ids, mask


def pagedrl_from(hf: torch.nn.Module) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    return model.eval()


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, attention_mask=mask))


def real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x * mask[..., None]


def exact(ours: CausalLM, hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> decoder_bound.Probed:
    """The model's exact logits (adapters as they are switched) and float32's bound on any forward's
    (`decoder_bound`, ~1e-5 here; an adapter's scaling or a transposed factor moves them by 1e-2),
    transformers' own float32 rotary frequencies included."""
    return decoder_bound.logits(ours, ids, mask, freq_error=freq_error(hf, ours))


def assert_within(probed: decoder_bound.Probed, mask: torch.Tensor, *logits: torch.Tensor) -> None:
    for got in logits:
        assert ((got.double() - probed.exact).abs() <= probed.bound())[mask.bool()].all()


@pytest.mark.parametrize("family,targets", [("llama-gqa-untied", None), ("qwen2-bias-tied", ["all-linear"]),
                                            ("smollm2-like", ["k_proj", "o_proj", "down_proj"]),
                                            ("mixtral", None), ("qwen3-moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                            ("phi3-longrope", ["all-linear"])])
def test_adapter_saved_here_gives_peft_logits(tmp_path, family, targets) -> None:
    hf = hf_model(FAMILIES[family])
    ours = pagedrl_from(hf)
    apply_lora(ours, LoRAConfig(r=4, lora_alpha=8, target_modules=targets), torch.Generator().manual_seed(0))
    randomise_adapter(ours)
    ours.eval()
    save_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = peft_model(input_ids=ids, attention_mask=mask).logits
    out = logits(ours, ids, mask)
    assert_within(exact(ours, hf, ids, mask), mask, ref, out)
    with peft_model.disable_adapter(), torch.no_grad():
        base = peft_model(input_ids=ids, attention_mask=mask).logits
    with disable_adapter(ours):
        base_ours = logits(ours, ids, mask)
        assert_within(exact(ours, hf, ids, mask), mask, base, base_ours)
    assert float(real(base - ref, mask).abs().max()) > 1e-2  # the adapter really changes the model


def test_a_trained_head_on_a_tied_base_is_refused_by_name(tmp_path) -> None:
    """PEFT's modules_to_save=["lm_head"] on a model whose head is its embedding keeps a copy of the head;
    pagedrl names the case instead of a bare KeyError."""
    hf = hf_model(FAMILIES["llama-mha-tied-bias"])
    ours = pagedrl_from(hf)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"],
                             task_type="CAUSAL_LM")
    peft.get_peft_model(hf, config).save_pretrained(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match=r"trains lm_head \(modules_to_save\), which this model ties"):
        load_adapter(ours, tmp_path / "adapter")


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "up_proj"], r".*\.(q_proj|v_proj|up_proj)",
                                     ["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"]])
def test_adapter_saved_by_peft_loads_here(tmp_path, targets) -> None:
    """Targets as names, as the ends of module names (PEFT matches an entry so), or as PEFT's one regular
    expression full-matched against module names."""
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    ours = pagedrl_from(hf)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.1, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    loaded = load_adapter(ours, tmp_path / "adapter")
    assert loaded.r == 8 and loaded.resolved_targets() == ["q_proj", "v_proj", "up_proj"]
    ours.eval()
    ids, mask = padded_batch(hf.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = peft_model(input_ids=ids, attention_mask=mask).logits
    assert_within(exact(ours, hf, ids, mask), mask, ref, logits(ours, ids, mask))


def test_merged_checkpoint_equals_the_live_adapter(tmp_path) -> None:
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    ours = pagedrl_from(hf)
    apply_lora(ours, LoRAConfig(r=4, target_modules=["all-linear"]), torch.Generator().manual_seed(1))
    randomise_adapter(ours)
    ids, mask = padded_batch(hf.config.vocab_size, seed=7)
    live = logits(ours.eval(), ids, mask)
    adapted = exact(ours, hf, ids, mask)
    assert_within(adapted, mask, live)
    merge_lora(ours)
    assert not list(lora_layers(ours))
    save_checkpoint(ours, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = back(input_ids=ids, attention_mask=mask).logits
    merged = exact(ours, back, ids, mask)
    assert_within(merged, mask, ref)
    # Merging rounds each weight once (U of it): its exact forward moves by less than a product's own
    # gamma(K) allowance, which the live model's bound carries in every product.
    assert ((merged.exact - adapted.exact).abs() <= adapted.bound())[mask.bool()].all()


def test_engine_generates_with_the_live_adapter_as_the_merged_checkpoint(tmp_path) -> None:
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    ours = pagedrl_from(hf)
    apply_lora(ours, LoRAConfig(r=4, target_modules=["all-linear"]), torch.Generator().manual_seed(2))
    randomise_adapter(ours, seed=4)
    ours.train()  # as a trainer holds it: dropout must not act in the engine's forward
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 33)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    live = [o.outputs[0].token_ids for o in LLM.from_module(ours, kv_cache_tokens=1024).generate(prompts, greedy)]
    with disable_adapter(ours):
        base = [o.outputs[0].token_ids for o in LLM.from_module(ours, kv_cache_tokens=1024).generate(prompts, greedy)]
    save_checkpoint(merge_lora(ours), tmp_path / "merged")
    merged = LLM.from_module(load_causal_lm(tmp_path / "merged"), kv_cache_tokens=1024)
    assert [o.outputs[0].token_ids for o in merged.generate(prompts, greedy)] == live
    assert base != live  # the adapter changes what is generated


def test_bad_adapter_configs_are_refused_by_field(tmp_path) -> None:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        read_adapter_config(folder)
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(CheckpointError, match="peft_type"):
        read_adapter_config(folder)
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["embed"]}))
    with pytest.raises(CheckpointError, match="target_modules"):
        read_adapter_config(folder)
    for key, value, words in (("alora_invocation_tokens", [5, 6], "alora_invocation_tokens=.* not supported"),
                              ("layer_replication", [[0, 2]], "layer_replication"),
                              ("target_modules", r"model\.layers\.0\.self_attn\.q_proj", "in some layers only"),
                              ("target_modules", r".*lm_head", "matches no decoder projection"),
                              ("target_modules", "(", "not a regular expression")):
        (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, key: value}))
        with pytest.raises(CheckpointError, match=words):
            read_adapter_config(folder)
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(CheckpointError, match=ADAPTER_WEIGHTS):
        load_adapter(CausalLM(ModelConfig.from_dict(dict(FAMILIES["llama-gqa-untied"]))), folder)


def test_dropout_gradient_equals_the_plain_computation_with_the_same_mask() -> None:
    """The adapter's dropout is recomputed in backward (not stored): its gradients must be those of
    PEFT's lora_B(lora_A(dropout(x))) * scaling with the same mask."""
    from pagedrl.model.lora import LoRALinear

    layer = LoRALinear(torch.nn.Linear(12, 10), r=3, lora_alpha=6, lora_dropout=0.3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(2, 5, 12, requires_grad=True)
    torch.manual_seed(7)
    layer(x).square().sum().backward()
    ours = [t.grad.clone() for t in (x, layer.lora_A.weight, layer.lora_B.weight)]
    for t in (x, layer.lora_A.weight, layer.lora_B.weight):
        t.grad = None
    torch.manual_seed(7)
    h = torch.nn.functional.dropout(x, 0.3, training=True)
    out = torch.nn.functional.linear(x, layer.weight, layer.bias) + layer.lora_B(layer.lora_A(h)) * layer.scaling
    out.square().sum().backward()
    # Two float32 evaluations of one expression of sums and products (the forward's 12 + 1 + 3 + 1
    # terms, the square, the backward's sums over 10 outputs, 3 ranks, 10 rows): each within gamma(64)
    # of the expression evaluated on the inputs' magnitudes (Higham, ch. 3), which float64 autograd on
    # them gives.
    leaves = [t.detach().double().abs().requires_grad_() for t in (x, layer.lora_A.weight, layer.lora_B.weight)]
    kept = (h != 0).double() / 0.7
    magnitude = (torch.nn.functional.linear(leaves[0], layer.weight.double().abs(), layer.bias.double().abs())
                 + (leaves[0] * kept) @ leaves[1].t() @ leaves[2].t() * layer.scaling)
    magnitude.square().sum().backward()
    for got, want, size in zip(ours, (x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad), leaves,
                               strict=True):
        assert ((got - want).double().abs() <= 2 * gamma(64) * size.grad).all()
    assert (h == 0).any()  # the mask dropped something
    assert layer.weight.grad is None  # the base stays frozen
