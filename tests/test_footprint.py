"""A model's footprint, known before it loads (`model/footprint.py`): parameters as transformers counts
them, active parameters of a mixture of experts by hand, KV bytes per token by the formula, and a
model too large for the memory free refused before any weight is read, with the numbers."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES, GEMMA_FAMILIES, MOE_FAMILIES, hf_model

from pagedrl.model import footprint as fp_module
from pagedrl.model.checkpoint import load_causal_lm
from pagedrl.model.config import ModelConfig
from pagedrl.model.footprint import DoesNotFit, footprint


@pytest.mark.parametrize("family", ["llama-mha-tied-bias", "qwen3-qknorm", *MOE_FAMILIES, "gemma3"])
def test_parameters_are_transformers_count_and_active_ones_the_routed_share(family) -> None:
    raw = {**FAMILIES, **GEMMA_FAMILIES}[family]
    cfg = ModelConfig.from_dict(raw)
    fp = footprint(cfg, torch.bfloat16)
    assert fp.parameters == hf_model(raw).num_parameters()
    assert fp.weight_bytes == 2 * fp.parameters
    assert fp.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    idle = sum((cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.expert_intermediate_size
               for layer in range(cfg.num_hidden_layers) if cfg.sparse_layer(layer))
    assert fp.active_parameters == fp.parameters - idle
    assert (idle > 0) == (family in MOE_FAMILIES)
    assert ("active per token" in fp.describe()) == (family in MOE_FAMILIES)


def test_a_model_larger_than_free_memory_is_refused_before_its_weights_are_read(tmp_path, monkeypatch) -> None:
    raw = FAMILIES["llama-gqa-untied"]
    folder = tmp_path / "model"
    hf_model(raw).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")  # reading it would fail another way
    need = footprint(ModelConfig.from_file(folder / "config.json"), torch.float32).weight_bytes
    monkeypatch.setattr(fp_module, "available_bytes", lambda device: (need - 1, "MemAvailable in /proc/meminfo"))
    with pytest.raises(DoesNotFit, match=rf"{folder}: the model needs .* GiB for its weights alone .* in float32\) "
                                         r"but cpu has .* GiB free \(MemAvailable"):
        load_causal_lm(folder, dtype=torch.float32)
    monkeypatch.setenv(fp_module.CHECK_ENV, "0")  # checked no more: now the broken file is what fails
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_causal_lm(folder, dtype=torch.float32)


def test_loaded_weights_are_held_once_in_the_precision_asked(tmp_path) -> None:
    raw = FAMILIES["llama-mha-tied-bias"]
    ref = hf_model(raw)
    ref.save_pretrained(tmp_path / "model")
    model = load_causal_lm(tmp_path / "model", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.model.inv_freq.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], p.to(torch.bfloat16), rtol=0, atol=0)
