"""QLoRA (`load_in_4bit` / `load_in_8bit` with `use_peft`): the storage formats against float64 hand
computations of bitsandbytes' rules, the trainers' losses and adapter gradients against PEFT (and
pagedrl's float LoRA) over the dequantized base, GRPO's log-prob contract on the quantized base, an
exact resume, no float copy of a quantized weight, and the refusals."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers
from preference_data import preference_rows
from test_grpo import REWARDS, exact_logps
from test_lora_training import sft_trainer
from test_trainer_resume import Interrupted, interrupt_at, metric_rows
from tiny_train import arithmetic_rows

from pagedrl.model import bnb_quant
from pagedrl.model.adapter import read_adapter_weights
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRALinear, lora_layers, merge_lora
from pagedrl.model.projections import LAYER_PROJECTIONS
from pagedrl.model.quantized_linear import (
    QuantizedBase,
    QuantizedLinear,
    quantize_projections,
    quantized_layers,
)
from pagedrl.train.adapters import attach_lora
from pagedrl.train.algorithms.dpo import DPO
from pagedrl.train.algorithms.grpo import GRPO
from pagedrl.train.algorithms.sft import SFT
from pagedrl.train.checkpointing import seed_everything
from pagedrl.train.config import TrainConfigError
from pagedrl.train.distributed import DistInfo
from pagedrl.train.offline_config import DPOConfig, SFTConfig
from pagedrl.train.rl.config import GRPOConfig

QLORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"],
             load_in_4bit=True, seed=0, report_to=["jsonl"], logging_steps=1, save_steps=1000)


# ---------------------------------------------------------------------------------------------
# The storage formats
# ---------------------------------------------------------------------------------------------

def test_nf4_table_is_the_normal_quantiles_of_the_qlora_paper() -> None:
    """bitsandbytes' `create_normal_map(0.9677083)`: 8 positive and 7 negative normal quantiles and an
    exact zero, divided by the largest; recomputed in float64 with torch's own inverse normal CDF."""
    offset = 0.9677083
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    values = values / values.max()
    assert torch.allclose(torch.tensor(bnb_quant.NF4_CODE, dtype=torch.float64), values, atol=2e-7, rtol=0)
    fp4 = bnb_quant.code_table("fp4")  # 1 sign, 2 exponent, 1 mantissa bit, over 12
    magnitudes = torch.tensor([0, 0.0625, 2, 3, 4, 6, 8, 12], dtype=torch.float64) / 12
    assert torch.equal(fp4.abs().unique(), magnitudes.float())
    dynamic = bnb_quant.dynamic_map()
    assert dynamic.numel() == 256 and dynamic[0] == -dynamic[-2] and dynamic[-1] == 1.0 and (dynamic.diff() > 0).all()


def hand_4bit(w: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, dequantized) of the QLoRA rule in float64: blocks of 64 of the flattened weight, each
    value's nearest code to value / block absmax."""
    flat = w.double().reshape(-1)
    pad = -flat.numel() % 64
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    codes = ((blocks / absmax)[..., None] - table.double()).abs().argmin(dim=-1)
    values = table.double()[codes] * absmax
    return codes.reshape(-1)[:flat.numel()], values.reshape(-1)[:flat.numel()].view(w.shape)


def unpacked(q: bnb_quant.Quantized4bit, numel: int) -> torch.Tensor:
    return torch.stack([q.packed >> 4, q.packed & 15], dim=1).reshape(-1)[:numel].long()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", [(96, 64), (5, 13)])  # whole blocks; a partial last block and an odd count
def test_4bit_codes_and_values_equal_the_float64_rule(quant_type: str, shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    q = bnb_quant.quantize_4bit(w, quant_type)
    codes, values = hand_4bit(w, bnb_quant.code_table(quant_type))
    ours = unpacked(q, w.numel())
    table = bnb_quant.code_table(quant_type)
    assert torch.equal(table[ours], table[codes].float())  # the same code value (fp4's ±0 alike)
    assert torch.allclose(bnb_quant.dequantize_4bit(q).double(), values, rtol=2e-7, atol=0)
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == (w.numel() + 1) // 2


def test_4bit_packs_the_first_value_in_the_high_nibble_and_keeps_zero_blocks() -> None:
    q = bnb_quant.quantize_4bit(torch.tensor([[-1.0, 1.0]]))
    assert q.packed.tolist() == [0x0F] and q.absmax.tolist() == [1.0]
    zero = bnb_quant.quantize_4bit(torch.zeros(2, 64))
    assert torch.equal(bnb_quant.dequantize_4bit(zero), torch.zeros(2, 64))


def test_double_quantization_stores_the_maxima_in_the_dynamic_map() -> None:
    w = torch.randn(64, 640, generator=torch.Generator().manual_seed(2)) * 0.05  # 640 blocks: 3 of 256
    plain, nested = bnb_quant.quantize_4bit(w), bnb_quant.quantize_4bit(w, nested=True)
    assert torch.equal(plain.packed, nested.packed) and nested.absmax.dtype == torch.uint8
    absmax = plain.absmax.double()
    offset = absmax.mean()
    centred = torch.nn.functional.pad(absmax - offset, (0, -absmax.numel() % 256)).view(-1, 256)
    scale = centred.abs().amax(dim=1, keepdim=True)
    dynamic = bnb_quant.dynamic_map().double()
    index = ((centred / scale)[..., None] - dynamic).abs().argmin(dim=-1)
    expected = (dynamic[index] * scale).reshape(-1)[:absmax.numel()] + offset
    assert torch.equal(nested.absmax.long(), index.reshape(-1)[:absmax.numel()])
    assert torch.allclose(bnb_quant.block_maxima(nested).double(), expected, rtol=1e-6, atol=0)
    assert nested.nbytes < plain.nbytes


def test_int8_rows_are_llm_int8_storage() -> None:
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))
    q, scale = bnb_quant.quantize_int8_rows(w)
    absmax = w.double().abs().amax(dim=1, keepdim=True)
    assert torch.equal(q.long(), torch.round(w.double() * 127 / absmax).long()) and q.dtype == torch.int8
    assert torch.allclose(bnb_quant.dequantize_int8_rows(q, scale).double(), q.double() * absmax / 127, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Trainers on the quantized base
# ---------------------------------------------------------------------------------------------

def randomize_adapters(model: torch.nn.Module) -> None:
    """Non-zero B (and A redrawn), so the adapter moves the outputs and both get gradients."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.1)


def dequantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`name.weight` -> the float32 dequantized weight of every quantized projection of `model`."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            out[name.replace(".base_layer", "") + ".weight"] = m.dequantized(torch.float32)
    return out


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            .removeprefix("base_model.model."): p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bits", [dict(load_in_4bit=True), dict(load_in_4bit=False, load_in_8bit=True)],
                         ids=["nf4", "int8"])
def test_sft_first_batch_loss_and_adapter_grads_equal_peft_over_the_dequantized_base(tiny_train_model, tmp_path,
                                                                                      bits) -> None:
    config = SFTConfig(**{**QLORA, **bits, "model": str(tiny_train_model), "output_dir": str(tmp_path)})
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    randomize_adapters(loaded.model)
    algo = SFT(config, loaded.model, loaded.tokenizer, DistInfo(), arithmetic_rows(8))
    batch = algo.collate(algo.examples[:4])
    n = batch.targets.numel()
    loss, _ = algo.loss(loaded.model, batch, torch.tensor(float(n)))
    loss.backward()

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_train_model, dtype=torch.float32)
    dequantized = dequantized_state(loaded.model)
    missing = hf.load_state_dict(dequantized, strict=False).missing_keys
    assert len(dequantized) == 2 * 7 and not set(dequantized) & set(missing)
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                         target_modules=list(LAYER_PROJECTIONS)))
    ours = {f"base_model.model.{k}": v for k, v in loaded.model.state_dict().items() if ".lora_" in k}
    assert not peft.set_peft_model_state_dict(peft_model, ours).unexpected_keys
    mask = None if batch.token_mask is None else batch.token_mask.long()
    logits = peft_model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.positions).logits
    logps = torch.log_softmax(logits.float(), -1).view(-1, logits.shape[-1])[batch.predict_at]
    ref_loss = -logps.gather(1, batch.targets[:, None]).sum() / n
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    got, want = lora_grads(loaded.model), lora_grads(peft_model)
    assert got.keys() == want.keys() and len(got) == 2 * 7 * 2
    for k in got:
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * float(want[k].abs().max())), k


def test_dpo_loss_and_grads_on_the_quantized_base_equal_float_lora_on_its_dequantized_weights(tiny_train_model,
                                                                                               tmp_path) -> None:
    """The policy's and the reference's (adapters off) log-probs both come from the quantized base."""
    config = DPOConfig(**{**QLORA, "model": str(tiny_train_model), "output_dir": str(tmp_path), "use_cpu": True})
    sides = []
    for quantized in (True, False):
        loaded = load_model(config.model, device="cpu", dtype=torch.float32)
        if quantized:
            attach_lora(config, loaded.model)
            weights = dequantized_state(loaded.model)
        else:
            loaded.model.load_state_dict(weights, strict=False)
            attach_lora(DPOConfig(**{**QLORA, "load_in_4bit": False, "model": str(tiny_train_model),
                                     "output_dir": str(tmp_path), "use_cpu": True}), loaded.model)
        randomize_adapters(loaded.model)
        algo = DPO(config, loaded.model, loaded.tokenizer, DistInfo(), preference_rows(8))
        batch = algo.collate(algo.examples[:4])
        loss, metrics = algo.loss(loaded.model, batch, torch.tensor(float(batch.num_pairs)))
        loss.backward()
        sides.append((loss.item(), float(metrics["rewards/margins"].total), lora_grads(loaded.model)))
    (loss_q, margin_q, grads_q), (loss_f, margin_f, grads_f) = sides
    assert abs(loss_q - loss_f) <= 1e-5 and abs(margin_q - margin_f) <= 1e-5 and margin_q != 0.0
    assert grads_q.keys() == grads_f.keys() and grads_q
    for k in grads_q:
        assert torch.allclose(grads_q[k], grads_f[k], rtol=1e-4, atol=1e-5 * float(grads_f[k].abs().max())), k


def test_grpo_rollouts_on_the_quantized_base_keep_the_logprob_contract(tiny_train_model, tmp_path) -> None:
    """The engine samples from the trainer's own quantized modules with the adapters live; its
    log-probs and the trainer's recompute are both within float32's bound of the exact log-probs of
    the float model whose weights are the dequantized base plus the adapters (merged)."""
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}"}], "answer": a + b}
            for a in range(2) for b in range(2)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = GRPOConfig(**{**QLORA, "model": str(tiny_train_model), "dataset": str(tmp_path / "prompts.jsonl"),
                           "output_dir": str(tmp_path / "out"), "num_generations": 4,
                           "per_device_train_batch_size": 8, "max_completion_length": 6, "temperature": 0.7,
                           "reward_funcs": [f"{tmp_path}/rewards.py:token_sum"], "beta": 0.1})
    seed_everything(0)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    randomize_adapters(loaded.model)
    algo = GRPO(config, loaded.model.train(), loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)
    assert algo.llm.engine.model is algo.model and algo.base_is_reference
    merged = merge_lora(copy.deepcopy(algo.model)).eval()  # dequantized base + s·B A, plain Linears
    assert not quantized_layers(merged)
    batches = algo.step_batches(1)
    for b in batches:
        with torch.no_grad():
            trainer = b.to_padded(algo.token_logps(algo.model, b).logps)
        exact, bound = (b.to_padded(t) for t in exact_logps(merged, b, algo.sampling))
        assert (torch.isfinite(bound) & b.mask).sum() >= 0.9 * b.mask.sum()
        for logp in (trainer, b.sampling_logps):  # the trainer's and the engine's
            assert ((logp.double() - exact).abs() <= bound)[b.mask].all()
    algo.close()


def test_a_qlora_run_resumes_to_the_same_adapter(tiny_train_model, tmp_path) -> None:
    fields = dict(save_steps=2, lora_target_modules=["all-linear"], load_in_4bit=True, use_bnb_nested_quant=True)
    straight = sft_trainer(tiny_train_model, tmp_path / "a", **fields)
    assert len(quantized_layers(straight.module)) == 2 * 7
    final = straight.train()
    first = sft_trainer(tiny_train_model, tmp_path / "b", **fields)
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    sft_trainer(tiny_train_model, tmp_path / "b", resume_from_checkpoint=True, **fields).train()
    assert metric_rows(tmp_path / "b") == metric_rows(tmp_path / "a")
    a, b = read_adapter_weights(final), read_adapter_weights(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("qweight" in k or "absmax" in k for k in a)  # the adapter only, as PEFT saves it


def test_no_float_copy_of_a_quantized_weight_is_held_or_saved_for_backward(tiny_train_model, tmp_path) -> None:
    config = SFTConfig(**{**QLORA, "lora_target_modules": ["q_proj", "v_proj"], "model": str(tiny_train_model),
                          "output_dir": str(tmp_path)})
    model = load_model(config.model, device="cpu", dtype=torch.float32).model
    shapes = {name: (m.out_features, m.in_features) for name, m in model.named_modules()
              if name.rpartition(".")[2] in LAYER_PROJECTIONS}
    attach_lora(config, model)
    for name, (n, k) in shapes.items():
        layer = model.get_submodule(name)
        base = layer.base_layer if isinstance(layer, LoRALinear) else layer
        assert isinstance(base, QuantizedLinear) and (not isinstance(layer, LoRALinear) or layer.weight is None)
        tensors = [*base.parameters(), *base.buffers()]
        assert all(t.numel() < n * k for t in tensors) and base.qweight.dtype == torch.uint8
        assert sum(t.numel() * t.element_size() for t in tensors) <= n * k * (0.5 + 4 / 64) + 4 * n
    projection_shapes = set(shapes.values())
    held = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_floating_point() and tuple(t.shape) in projection_shapes]
    assert not held, held
    saved: list[tuple[int, ...]] = []
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = model.logits(model(ids)).float().logsumexp(-1).sum()
    loss.backward()
    assert saved and not projection_shapes & set(saved) and not projection_shapes & {s[::-1] for s in saved}


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, key, words", [
    (dict(load_in_4bit=True), "load_in_4bit", "use_peft"),
    (dict(load_in_8bit=True), "load_in_8bit", "use_peft"),
    (dict(use_peft=True, load_in_4bit=True, load_in_8bit=True), "load_in_4bit", "choose one"),
    (dict(use_peft=True, load_in_4bit=True, fsdp="full_shard"), "load_in_4bit", "FSDP"),
    (dict(use_peft=True, load_in_4bit=True, bnb_4bit_quant_type="int4"), "bnb_4bit_quant_type", "nf4, fp4"),
    (dict(use_peft=True, load_in_4bit=True, bnb_4bit_compute_dtype="half"), "bnb_4bit_compute_dtype", "bfloat16"),
])
def test_unusable_quantization_settings_are_refused_in_one_line(tmp_path, fields, key, words) -> None:
    with pytest.raises(TrainConfigError) as e:
        SFTConfig(output_dir=str(tmp_path), **fields)
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value)


def test_a_projection_that_is_not_a_plain_linear_is_refused(tiny_train_model) -> None:
    model = load_model(tiny_train_model, device="cpu", dtype=torch.float32).model
    attn = model.model.layers[0].self_attn
    attn.q_proj = GGUFLinear(torch.zeros(attn.q_proj.out_features, 68, dtype=torch.uint8), 8, 64)  # Q8_0 blocks
    with pytest.raises(ValueError, match=r"^load_in_4bit: .*q_proj \(GGUFLinear\)") as e:
        quantize_projections(model, QuantizedBase(4))
    assert "\n" not in str(e.value)


def test_merge_of_a_qlora_adapter_dequantizes_then_merges(tiny_train_model, tmp_path) -> None:
    """`pagedrl merge --load-in-4bit`: the float folder computes what the trained QLoRA module computes;
    merged into the float weights instead, it differs by the base's quantization error."""
    from pagedrl.merge import merge_main
    from pagedrl.model.adapter import save_adapter

    config = SFTConfig(**{**QLORA, "model": str(tiny_train_model), "output_dir": str(tmp_path),
                          "lora_target_modules": ["q_proj", "v_proj"]})
    model = load_model(config.model, device="cpu", dtype=torch.float32).model
    attach_lora(config, model)
    randomize_adapters(model)
    save_adapter(model, tmp_path / "adapter")
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        trained = model.eval().logits(model(ids))
    logits = {}
    for flags in (["--load-in-4bit"], []):
        out = tmp_path / f"merged{len(flags)}"
        assert merge_main([str(tiny_train_model), str(tmp_path / "adapter"), str(out), *flags]) == 0
        merged = load_model(out, device="cpu", dtype=torch.float32).model.eval()
        with torch.no_grad():
            logits[len(flags)] = merged.logits(merged(ids))
    assert torch.allclose(logits[1], trained, rtol=0, atol=2e-5 * float(trained.abs().max()))
    assert (logits[0] - trained).abs().max() > 1e-3


def test_a_ppo_critic_started_from_the_policy_shares_its_quantized_base(tiny_train_model, tmp_path) -> None:
    from pagedrl.train.rl.config import PPOConfig
    from pagedrl.train.rl.critic import load_critic, lora_critic

    config = PPOConfig(**{**QLORA, "model": str(tiny_train_model), "output_dir": str(tmp_path), "critic": "policy"})
    policy = load_model(tiny_train_model, device="cpu", dtype=torch.float32).model
    attach_lora(config, policy)
    critic = load_critic("policy", tiny_train_model, None, torch.device("cpu"), 0)
    lora_critic(config, critic, policy)
    ours, theirs = quantized_layers(policy), quantized_layers(critic)
    assert len(ours) == len(theirs) == 2 * 7 and all(a.qweight is b.qweight for a, b in zip(ours, theirs, strict=True))
