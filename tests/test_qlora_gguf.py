"""QLoRA on a GGUF model (`model/qlora_gguf.py`): the projections the file holds in at most the bits asked
for keep the file's own blocks (their dequantized values the float model's weights, bit for bit, the q/k
rows in transformers' order), the others are quantized as before; the trainer's first-batch loss and
adapter gradients equal float LoRA on the dequantized base; GRPO's rollouts on the kept blocks keep the
log-prob contract; `pagedrl merge --load-in-4bit` folds into the same weights; a PPO critic shares the
blocks; an explicit `bnb_4bit_quant_type` quantizes every projection."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import TINY, write_tiny_gguf
from test_grpo import REWARDS, exact_logps
from test_qlora import QLORA, dequantized_state, lora_grads, randomize_adapters
from tiny import hf_model
from tiny_train import arithmetic_rows

from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRALinear, merge_lora
from pagedrl.model.projections import LAYER_PROJECTIONS
from pagedrl.model.quantized_linear import Linear4bit, quantized_layers
from pagedrl.train.adapters import attach_lora, describe
from pagedrl.train.algorithms.grpo import GRPO
from pagedrl.train.algorithms.sft import SFT
from pagedrl.train.checkpointing import seed_everything
from pagedrl.train.distributed import DistInfo
from pagedrl.train.offline_config import SFTConfig
from pagedrl.train.rl.config import GRPOConfig

# 4-bit types (kept under load_in_4bit), a 5-bit and an 8-bit one (NF4 there, kept under load_in_8bit);
# sizes K-quants' 256-value blocks divide.
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
         "ffn_up": Q.Q5_0, "ffn_down": Q.Q4_0, "token_embd": Q.Q8_0}
FOUR_BIT = {"q_proj": "Q4_K", "k_proj": "Q4_0", "v_proj": "Q4_1", "gate_proj": "Q4_1", "down_proj": "Q4_0"}
WIDE = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("qlora-gguf") / "mixed.gguf", hf_model(WIDE, seed=3), types=TYPES)


def projections(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each decoder projection's frozen base layer, by module name."""
    out = {}
    for name, m in model.named_modules():
        if name.rpartition(".")[2] in LAYER_PROJECTIONS:
            out[name] = m.base_layer if isinstance(m, LoRALinear) else m
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_projections_of_at_most_the_bits_asked_keep_the_files_blocks(mixed_gguf: Path, tmp_path: Path, bits: int) -> None:
    config = SFTConfig(**{**QLORA, "load_in_4bit": bits == 4, "load_in_8bit": bits == 8, "model": str(mixed_gguf),
                          "output_dir": str(tmp_path)})
    float_model = load_model(config.model, device="cpu", dtype=torch.float32).model
    weights = {name: m.weight.detach().clone() for name, m in projections(float_model).items()}
    attach_lora(config, float_model)
    layers = projections(float_model)
    assert layers.keys() == weights.keys() and len(layers) == 2 * 7
    for name, layer in layers.items():
        kind = name.rpartition(".")[2]
        if bits == 8 or kind in FOUR_BIT:
            assert type(layer) is GGUFLinear, name
            assert bits == 8 or layer.storage == f"the GGUF file's own {FOUR_BIT[kind]} blocks"
            assert torch.equal(layer.dequantized(), weights[name]), name  # the file's values, rows in place
        else:  # o_proj (Q8_0) and up_proj (Q5_0) hold more than 4 bits: NF4 of the float weights
            assert type(layer) is Linear4bit and layer.quant_type == "nf4", name
    assert "GGUF file's own" in describe(float_model)


def test_an_explicit_quant_type_quantizes_every_projection(mixed_gguf: Path, tmp_path: Path) -> None:
    for quant_type in ("nf4", "fp4"):
        config = SFTConfig(**{**QLORA, "bnb_4bit_quant_type": quant_type, "model": str(mixed_gguf),
                              "output_dir": str(tmp_path)})
        model = load_model(config.model, device="cpu", dtype=torch.float32).model
        attach_lora(config, model)
        assert {(type(m), m.quant_type) for m in projections(model).values()} == {(Linear4bit, quant_type)}


def test_sft_loss_and_adapter_grads_on_the_files_blocks_equal_float_lora(mixed_gguf: Path, tmp_path: Path) -> None:
    """On the dequantized base: for the kept projections the float model's own weights."""
    config = SFTConfig(**{**QLORA, "model": str(mixed_gguf), "output_dir": str(tmp_path)})
    sides = []
    for quantized in (True, False):
        loaded = load_model(config.model, device="cpu", dtype=torch.float32)
        if quantized:
            attach_lora(config, loaded.model)
            weights = dequantized_state(loaded.model)
        else:
            loaded.model.load_state_dict(weights, strict=False)
            attach_lora(SFTConfig(**{**QLORA, "load_in_4bit": False, "model": str(mixed_gguf),
                                     "output_dir": str(tmp_path)}), loaded.model)
        randomize_adapters(loaded.model)
        algo = SFT(config, loaded.model, loaded.tokenizer, DistInfo(), arithmetic_rows(8))
        batch = algo.collate(algo.examples[:4])
        loss, _ = algo.loss(loaded.model, batch, torch.tensor(float(batch.targets.numel())))
        loss.backward()
        sides.append((loss.item(), lora_grads(loaded.model)))
    (loss_q, grads_q), (loss_f, grads_f) = sides
    assert loss_q == loss_f  # the same weights, the same products
    assert grads_q.keys() == grads_f.keys() and len(grads_q) == 2 * 7 * 2
    for k in grads_q:
        assert torch.equal(grads_q[k], grads_f[k]), k


def test_grpo_rollouts_on_the_files_blocks_keep_the_logprob_contract(mixed_gguf: Path, tmp_path: Path) -> None:
    """The engine multiplies the kept blocks with its GGUF kernels; its log-probs and the trainer's are
    within float32's bound of the exact log-probs of the merged float model."""
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}"}], "answer": a + b}
            for a in range(2) for b in range(2)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = GRPOConfig(**{**QLORA, "model": str(mixed_gguf), "dataset": str(tmp_path / "prompts.jsonl"),
                           "output_dir": str(tmp_path / "out"), "num_generations": 4, "bf16": False,
                           "per_device_train_batch_size": 8, "max_completion_length": 6, "temperature": 0.7,
                           "reward_funcs": [f"{tmp_path}/rewards.py:token_sum"], "beta": 0.1})
    seed_everything(0)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    attach_lora(config, loaded.model)
    randomize_adapters(loaded.model)
    algo = GRPO(config, loaded.model.train(), loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)
    assert algo.llm.engine.model is algo.model
    assert sum(type(m) is GGUFLinear for m in quantized_layers(algo.model)) == 2 * 5
    merged = merge_lora(copy.deepcopy(algo.model)).eval()
    assert not quantized_layers(merged)
    for b in algo.step_batches(1):
        with torch.no_grad():
            trainer = b.to_padded(algo.token_logps(algo.model, b).logps)
        exact, bound = (b.to_padded(t) for t in exact_logps(merged, b, algo.sampling))
        assert (torch.isfinite(bound) & b.mask).sum() >= 0.9 * b.mask.sum()
        for logp in (trainer, b.sampling_logps):
            assert ((logp.double() - exact).abs() <= bound)[b.mask].all()
    algo.close()


def test_merge_and_a_ppo_critic_use_the_same_blocks(mixed_gguf: Path, tmp_path: Path) -> None:
    """`pagedrl merge --load-in-4bit` rebuilds the trained base (file blocks and NF4 alike) from the
    adapter's recorded GGUF; a critic started from the policy holds the policy's blocks themselves."""
    from pagedrl.merge import merge_main
    from pagedrl.model.adapter import save_adapter
    from pagedrl.train.rl.config import PPOConfig
    from pagedrl.train.rl.critic import load_critic, lora_critic

    config = PPOConfig(**{**QLORA, "model": str(mixed_gguf), "output_dir": str(tmp_path), "critic": "policy"})
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    model = loaded.model
    attach_lora(config, model)
    randomize_adapters(model)
    save_adapter(model, tmp_path / "adapter")
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        trained = model.eval().logits(model(ids))
    assert merge_main([str(mixed_gguf), str(tmp_path / "adapter"), str(tmp_path / "merged"), "--load-in-4bit"]) == 0
    merged = load_model(tmp_path / "merged", device="cpu", dtype=torch.float32).model.eval()
    with torch.no_grad():
        assert torch.allclose(merged.logits(merged(ids)), trained, rtol=0, atol=2e-5 * float(trained.abs().max()))

    critic = load_critic("policy", loaded.path, None, torch.device("cpu"), 0)
    lora_critic(config, critic, model)
    ours, theirs = quantized_layers(model), quantized_layers(critic)
    assert len(ours) == len(theirs) == 2 * 7 and all(a.qweight is b.qweight for a, b in zip(ours, theirs, strict=True))


def test_a_qwen2_files_biases_go_with_its_blocks_and_experts_are_refused(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases (float tensors beside the blocks) stay on the kept layers: the base (adapters
    at zero) computes the float model's logits bit for bit; a mixture of experts is refused in one line,
    as on a float base."""
    from test_gguf_families import family_gguf

    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    _, path = family_gguf("qwen2", tmp_path, types=dict.fromkeys(kinds, Q.Q4_0))
    config = SFTConfig(**{**QLORA, "model": str(path), "output_dir": str(tmp_path / "out")})
    model = load_model(config.model, device="cpu", dtype=torch.float32).model.eval()
    ids = torch.tensor([[3, 40, 7, 99, 12, 5, 61, 8]])
    with torch.no_grad():
        want = model.logits(model(ids))
    attach_lora(config, model)
    layers = projections(model)
    assert all(type(m) is GGUFLinear for m in layers.values()) and len(layers) == 2 * 7
    assert layers["model.layers.0.self_attn.q_proj"].bias is not None
    with torch.no_grad():
        assert torch.equal(model.logits(model(ids)), want)
    (tmp_path / "moe").mkdir()
    _, moe = family_gguf("qwen3-moe", tmp_path / "moe", types={"ffn_gate_exps": Q.Q4_1, "ffn_up_exps": Q.Q4_1,
                                                               "ffn_down_exps": Q.Q4_1})
    model = load_model(str(moe), device="cpu", dtype=torch.float32).model
    with pytest.raises(ValueError, match=r"^load_in_4bit: a mixture of experts' base cannot be held quantized"):
        attach_lora(SFTConfig(**{**QLORA, "model": str(moe), "output_dir": str(tmp_path / "out")}), model)


def test_a_run_loads_the_kept_blocks_without_a_float_copy_and_gets_the_same_base(mixed_gguf: Path, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_run` loads a GGUF QLoRA base with its blocks kept (no float32 projection is ever built: the
    float folder's loader is not called), and the model equals a float load followed by `quantize_base`:
    the same layers of the same bytes, the same float embedding and head, the same logits."""
    from pagedrl.model import loader
    from pagedrl.train.start import start_run

    config = SFTConfig(**{**QLORA, "model": str(mixed_gguf), "output_dir": str(tmp_path)})
    reference = load_model(config.model, device="cpu", dtype=torch.float32).model
    attach_lora(config, reference)
    with monkeypatch.context() as mp:
        mp.setattr(loader, "load_causal_lm", lambda *a, **k: pytest.fail("a float load of the model"))
        _, loaded = start_run(config, "SFT needs")
    model = loaded.model
    ours, theirs = projections(model), projections(reference)
    assert ours.keys() == theirs.keys()
    for name, layer in ours.items():
        other = theirs[name]
        assert type(layer) is type(other), name
        assert all(torch.equal(a, b) for a, b in zip(layer.buffers(), other.buffers(), strict=True)), name
    assert type(model.model.embed_tokens) is torch.nn.Embedding and model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        assert torch.equal(model.eval().logits(model(ids)), reference.eval().logits(reference(ids)))


def test_a_run_on_the_files_blocks_resumes_exactly_and_not_on_another_base(mixed_gguf: Path, tmp_path: Path) -> None:
    """Interrupted and resumed, the run ends with the adapter of the run that was not; resumed with the
    projections held another way (`bnb_4bit_quant_type: nf4`), it is refused naming the settings."""
    from test_lora_training import sft_trainer
    from test_trainer_resume import Interrupted, interrupt_at, metric_rows

    from pagedrl.model.adapter import read_adapter_weights

    fields = dict(save_steps=2, lora_target_modules=["all-linear"], load_in_4bit=True)
    final = sft_trainer(mixed_gguf, tmp_path / "a", **fields).train()
    first = sft_trainer(mixed_gguf, tmp_path / "b", **fields)
    assert sum(type(m) is GGUFLinear for m in quantized_layers(first.module)) == 2 * 5
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    with pytest.raises(ValueError, match=r"^resume_from_checkpoint: .* trained on a base held as .*GGUF file's own.*"
                                         r"bnb_4bit_quant_type\)$"):
        sft_trainer(mixed_gguf, tmp_path / "b", resume_from_checkpoint=True, bnb_4bit_quant_type="nf4", **fields).train()
    sft_trainer(mixed_gguf, tmp_path / "b", resume_from_checkpoint=True, **fields).train()
    assert metric_rows(tmp_path / "b") == metric_rows(tmp_path / "a")
    a, b = read_adapter_weights(final), read_adapter_weights(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_products_weight_is_written_into_one_buffer_per_shape(mixed_gguf: Path, tmp_path: Path) -> None:
    """`product_weight` on a CPU: the dequantized values (GGUF blocks and NF4 alike) written into this
    thread's buffer of the weight's shape, the same buffer for every layer of that shape."""
    from pagedrl.model.quantized_linear import product_weight

    config = SFTConfig(**{**QLORA, "model": str(mixed_gguf), "output_dir": str(tmp_path)})
    model = load_model(config.model, device="cpu", dtype=torch.float32).model
    attach_lora(config, model)
    layers = projections(model)
    q0, q1 = layers["model.layers.0.self_attn.q_proj"], layers["model.layers.1.self_attn.q_proj"]
    up = layers["model.layers.0.mlp.up_proj"]
    assert type(q0) is GGUFLinear and type(up) is Linear4bit
    for layer in (q0, up):
        assert torch.equal(product_weight(layer, torch.float32), layer.dequantized())
        assert torch.equal(product_weight(layer, torch.bfloat16), layer.dequantized(torch.bfloat16))
    first = product_weight(q0, torch.float32)
    assert product_weight(q1, torch.float32).data_ptr() == first.data_ptr()
    assert torch.equal(first, q1.dequantized()) and not torch.equal(q0.dequantized(), q1.dequantized())


def test_a_buffer_made_in_an_engine_step_is_not_the_trainers(tmp_path: Path) -> None:
    """An engine step runs in inference mode, a trainer's forward outside it: torch refuses to write an
    inference tensor outside inference mode, so each has a buffer of its own (a fresh thread: fresh buffers,
    the engine's made first as in a GRPO run)."""
    import threading

    from pagedrl.model.quantized_linear import QuantizedBase, product_weight

    layer = QuantizedBase(4).layer(torch.nn.Linear(128, 64, bias=False))
    errors: list[BaseException] = []

    def engine_then_trainer() -> None:
        try:
            with torch.inference_mode():
                product_weight(layer, torch.float32)
            assert torch.equal(product_weight(layer, torch.float32), layer.dequantized())
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    thread = threading.Thread(target=engine_then_trainer)
    thread.start()
    thread.join()
    assert not errors, errors


def test_a_bf16_batch_invariant_engine_step_multiplies_each_layers_own_weight() -> None:
    """Under a trainer's bf16 autocast the engine's rollouts are batch-invariant, whose products keep a
    packed copy of a weight that outlives the call, found again by the tensor and its version. Every layer
    of one shape dequantizes into the same buffer, and an engine step's buffer (an inference tensor) has
    no version: a packed copy of it would give the first layer's weight to all of them (a QLoRA GRPO run in
    bf16 sampled "peuticpeutic..." from the default model). Each product must use its own layer's weight."""
    from pagedrl.model import batch_invariant
    from pagedrl.model.quantized_linear import QuantizedBase

    torch.manual_seed(0)
    layers = [QuantizedBase(4).layer(torch.nn.Linear(576, 1536, bias=False)) for _ in range(3)]
    x = torch.randn(96, 576)
    with torch.inference_mode(), batch_invariant.scope(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [layer(x).float() for layer in layers]
    for layer, out in zip(layers, outs, strict=True):
        reference = x.bfloat16().float() @ layer.dequantized(torch.bfloat16).float().T
        torch.testing.assert_close(out, reference, rtol=2e-2, atol=5e-2)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
