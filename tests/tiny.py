"""Tiny random configurations of every supported family, shared by the reference tests."""

from __future__ import annotations

import copy
from typing import Any

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama-gqa-untied": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                             num_key_value_heads=2, tie_word_embeddings=False),
    "llama-mha-tied-bias": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                                num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True),
    "llama3-rope": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=2,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
    "llama-linear-rope": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                              num_key_value_heads=1,
                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "mistral": dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral", num_key_value_heads=2,
                    sliding_window=None),
    "qwen2-bias-tied": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_key_value_heads=2,
                            tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1000000.0}),
    "qwen3-qknorm": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2,
                         head_dim=24, tie_word_embeddings=False),
    "smollm2-like": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=1,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                    "rope_theta": 100000.0}),
    # Mixtures of experts: 8 experts, 2 per token. Qwen3-MoE's second layer is dense (mlp_only_layers)
    # and its top-2 weights are not renormalised, so both of the family's switches are exercised.
    "mixtral": dict(BASE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_key_value_heads=2,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "qwen3-moe": dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_key_value_heads=2,
                      head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      mlp_only_layers=[1], norm_topk_prob=False),
    # Phi-3 with fused qkv_proj / gate_up_proj, Phi-4-mini's partial rotation (0.75 of each head) and
    # LongRoPE: the attention factor (max / original = 4) everywhere, the long factors from position 64 on,
    # which the engine tests' longest prompt (61 tokens) crosses while it generates.
    "phi3-longrope": dict(BASE, architectures=["Phi3ForCausalLM"], model_type="phi3", num_key_value_heads=2,
                          partial_rotary_factor=0.75, original_max_position_embeddings=64,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                                           "long_factor": [2.0, 2.7, 3.4, 4.1, 4.8, 5.5]}),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe")
FUSED_FAMILIES = ("phi3-longrope",)  # one qkv_proj and one gate_up_proj a layer: no CPU decode program


def hf_model(raw: dict[str, Any], seed: int = 0):
    """A transformers model with random weights (biases, norms and attention sinks randomised too, so they count)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    raw = copy.deepcopy(raw)  # transformers completes the rope parameters in place
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    cfg.architectures = raw["architectures"]
    cls = getattr(transformers, raw["architectures"][0])
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router: a bias that steers the choice
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def ours_from(hf):
    """pagedrl's model of a transformers model: its config read back, its state dict loaded strictly (every
    name transformers holds, the families' norms, sinks, routers and buffers included, and no other)."""
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())
    return model.eval()


def padded_batch(vocab: int, length: int = 30, left: int = 6, right: int = 21):
    """Three rows of `length` random tokens: one whole, one padded on the left (`left` pads), one on the
    right (from `right` on); long enough to cross the tiny families' windows of 8."""
    import torch

    ids = torch.randint(3, vocab, (3, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, :left] = 0
    mask[2, right:] = 0
    return ids, mask


def ours_logits(model, ids, mask=None):
    import torch

    with torch.no_grad():
        return model.logits(model(ids, attention_mask=mask))


def assert_checkpoint_round_trips(ours, hf, folder):
    """pagedrl's checkpoint of `ours` (a twin of transformers' `hf`): transformers reads it as the same class
    with `hf`'s very logits, and pagedrl reads it back to the same config and logits. Returns
    transformers' model of it."""
    import dataclasses

    import torch
    import transformers

    from pagedrl.model.checkpoint import load_causal_lm, save_checkpoint

    save_checkpoint(ours, folder)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    again = load_causal_lm(folder, dtype=torch.float32).eval()
    assert dataclasses.replace(again.config, extra={}) == dataclasses.replace(ours.config, extra={})
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref, got = hf(input_ids=ids, attention_mask=mask).logits, back(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(ref, got)
    assert torch.equal(ours_logits(again, ids, mask), ours_logits(ours, ids, mask))
    return back


def randomise_adapter(model, seed: int = 3, scale: float = 0.1) -> None:
    """B starts at zero (the adapter is then a no-op): draw it, so a comparison means something."""
    import torch

    from pagedrl.model.expert_lora import expert_adapters
    from pagedrl.model.lora import lora_layers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in [*lora_layers(model), *expert_adapters(model)]:
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * scale)


def assert_adapter_loads_in_peft(ours, hf, folder, **batch):
    """`ours` (its LoRA layers applied) with B drawn, saved as a PEFT adapter that `peft` loads onto
    transformers' `hf` with the same logits on a padded batch (within 1e-5), and that changes them.
    `batch`: `padded_batch`'s sizes. Returns PEFT's model."""
    import peft
    import torch

    from pagedrl.model.adapter import save_adapter

    randomise_adapter(ours)
    ours.eval()
    save_adapter(ours, folder)
    ids, mask = padded_batch(hf.config.vocab_size, **batch)
    with torch.no_grad():
        base = hf(input_ids=ids, attention_mask=mask).logits
        theirs = peft.PeftModel.from_pretrained(hf, folder).eval()
        ref = theirs(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((ours_logits(ours, ids, mask) - ref)[real].abs().max()) < 1e-5
    assert float((base - ref)[real].abs().max()) > 1e-2  # the adapter changes the model
    return theirs


def freq_error(hf, ours):
    """How far transformers' float32 rotary frequencies are from a pagedrl model's (`decoder_bound`'s
    `freq_error`); LongRoPE's: the larger of the short and the long set's error per pair (transformers'
    buffer holds the set of its last forward, so both are formed here as it forms them)."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = next(m for m in hf.modules() if type(m).__name__.endswith("RotaryEmbedding"))  # under PEFT too
    ours_freq = ours.model.inv_freq.double()
    if getattr(rotary, "rope_type", None) != "longrope":
        return (rotary.inv_freq.double() - ours_freq).abs()
    init = ROPE_INIT_FUNCTIONS["longrope"]
    longest = rotary.config.rope_parameters["original_max_position_embeddings"] + 1
    sets = torch.stack([init(rotary.config)[0], init(rotary.config, seq_len=longest)[0]]).double()
    return (sets - ours_freq).abs().amax(0)


# Gemma 2/3: windows of 8 tokens, so short test sequences cross them; layers sliding, full, sliding.
# Kept apart from FAMILIES: their windowed layers take the engine's reference attention, which the
# fast-path and batch-invariant suites do not cover (tests/test_gemma.py holds their checks).
GEMMA_BASE = dict(BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  query_pre_attn_scalar=24, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")
GEMMA_FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": dict(GEMMA_BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    "gemma2": dict(GEMMA_BASE, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}


# gpt-oss: 4 experts, 2 per token, attention sinks, layers sliding (window 8) then full, YaRN stretching an
# original context of 64 by 4 (its ramp blends the second rotary pair), and a SwiGLU clamp low enough to bite on these
# weights. Kept apart from FAMILIES for the reason Gemma is (its layers take the reference attention).
GPT_OSS_FAMILIES: dict[str, dict[str, Any]] = {
    "gpt-oss": dict(BASE, architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_key_value_heads=2,
                    head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
}

# DeepSeek-V3 (Kimi K2's architecture): latent attention (a 32-wide latent and 8 rotated features),
# 8 routed experts in 4 groups (2 groups eligible, 2 experts a token), one shared expert, the first
# of 3 layers dense. The second keeps queries uncompressed (q_lora_rank null), rotates in halves
# (rope_interleave false) and stretches the context with yarn, whose mscale changes the softmax scale.
# Kept apart from FAMILIES: latent attention takes the engine's own path (tests/test_deepseek_v3.py).
DEEPSEEK_BASE = dict(BASE, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4,
                     topk_group=2, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     tie_word_embeddings=False)
DEEPSEEK_FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(DEEPSEEK_BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        rope_interleave=True),
    "deepseek-v3-yarn": dict(DEEPSEEK_BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                             q_lora_rank=None, rope_interleave=False,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 64, "mscale": 1.0,
                                              "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}),
}
