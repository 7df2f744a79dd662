"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, Kimi K2's architecture) against transformers' own class, on
tiny models: logits (latent attention, both rotary layouts, yarn's scales; DeepSeek's routing), the
config and checkpoint both ways, what the paged cache holds per token, the engine's greedy tokens
(prefix sharing, chunked prefill, preemption) and log-probs, the first SFT and DPO batches, a LoRA
adapter through PEFT, and `pagedrl serve`."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny import DEEPSEEK_FAMILIES, hf_model

from pagedrl.model.checkpoint import load_causal_lm, save_checkpoint
from pagedrl.model.config import ConfigError, ModelConfig
from pagedrl.model.decoder import CausalLM

FAMILIES = sorted(DEEPSEEK_FAMILIES)


def ours_from(hf: torch.nn.Module) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())  # strict: transformers' names, the router's bias buffer included
    return model.eval()


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 17:] = 0
    return ids, mask


def ours_logits(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, attention_mask=mask))


def max_gap(ours: CausalLM, hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    return float((ours_logits(ours, ids, mask) - ref)[mask.bool()].abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_and_the_routing_rules_matter(family: str) -> None:
    """Within 1e-5 on a padded batch; the same weights without the router's correction bias, or with
    every group eligible, are far off, so both were applied (and chose differently)."""
    hf = hf_model(DEEPSEEK_FAMILIES[family])
    ours = ours_from(hf)
    ids, mask = padded_batch(hf.config.vocab_size)
    assert max_gap(ours, hf, ids, mask) < 1e-5
    routers = [layer.mlp.gate for layer in ours.model.layers[1:]]
    for router in routers:
        router.topk_group = router.n_group
    assert max_gap(ours, hf, ids, mask) > 1e-4
    for router in routers:
        router.topk_group = hf.config.topk_group
        router.e_score_correction_bias.zero_()
    assert max_gap(ours, hf, ids, mask) > 1e-4


def test_the_config_as_transformers_reads_it() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_FAMILIES["deepseek-v3-yarn"])
    rules = cfg.deepseek
    assert cfg.head_dim == 8 and cfg.kv_cache_layout == (1, 40, False) and rules.q_lora_rank is None
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{k: v for k, v in cfg.to_dict().items() if k != "model_type"}))
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(rules.softmax_scale, rel=1e-12)
    assert rules.softmax_scale != pytest.approx(24 ** -0.5)  # yarn's mscale² moved it
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(ours_from(hf).model.attention_factor, rel=1e-12)
    assert torch.equal(hf.model.rotary_emb.inv_freq, ours_from(hf).model.inv_freq)
    for change, field in [(dict(n_group=3), "n_group"), (dict(topk_group=5), "topk_group"),
                          (dict(num_key_value_heads=2), "num_key_value_heads"),
                          (dict(qk_rope_head_dim=7), "qk_rope_head_dim"), (dict(q_lora_rank=0), "q_lora_rank")]:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_dict(dict(DEEPSEEK_FAMILIES["deepseek-v3"], **change))


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_round_trip_through_transformers(tmp_path, family: str) -> None:
    """transformers' folder loads in pagedrl; pagedrl's folder holds the very tensor names transformers
    writes (experts one by one, the router's bias) and transformers loads it with the same logits."""
    hf = hf_model(DEEPSEEK_FAMILIES[family])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_causal_lm(tmp_path / "hf").eval()
    save_checkpoint(ours, tmp_path / "ours")
    names = [set(safe_open(str(tmp_path / d / "model.safetensors"), "pt").keys()) for d in ("hf", "ours")]
    assert names[0] == names[1] and "model.layers.2.mlp.gate.e_score_correction_bias" in names[1]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids, mask = padded_batch(hf.config.vocab_size)
    assert max_gap(ours, back, ids, mask) < 1e-5
