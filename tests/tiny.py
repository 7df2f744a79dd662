"""Tiny random configurations of every supported family, shared by the reference tests."""

from __future__ import annotations

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
}
MOE_FAMILIES = ("mixtral", "qwen3-moe")


def hf_model(raw: dict[str, Any], seed: int = 0):
    """A transformers model with random weights (biases and norms randomised too, so they count)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    cfg.architectures = raw["architectures"]
    cls = getattr(transformers, raw["architectures"][0])
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model

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
