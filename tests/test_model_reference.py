"""pagedrl's decoder against transformers on the same weights, for every supported family."""

from __future__ import annotations

import decoder_bound
import pytest
import torch
import transformers
from tiny import FAMILIES, freq_error, hf_model

from pagedrl.model.checkpoint import load_causal_lm, save_checkpoint
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM


def padded_batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 24), generator=g)
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    mask[2, 17:] = 0  # right padding
    return ids, mask


def assert_float32_forwards(ours: CausalLM, hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                            *logits: torch.Tensor) -> None:
    """Each float32 forward's logits are as near the exact ones (float64, `decoder_bound`) as float32
    rounding lets any forward be, on real tokens: ~1e-5 here, where float32 is ~3e-7 off and a wrong
    rotation sign moves them by 6e-3, a mask off by one by 0.4. transformers forms its rotary
    frequencies in float32 itself, up to 2 units off the model's."""
    probed = decoder_bound.logits(ours, ids, mask, freq_error=freq_error(hf, ours))
    real = mask.bool()[..., None]
    for got in logits:
        assert ((got.double() - probed.exact).abs() <= probed.bound())[real.expand_as(got)].all()


def pagedrl_from(hf: torch.nn.Module) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_on_padded_batch(family: str) -> None:
    hf = hf_model(FAMILIES[family])
    ours = pagedrl_from(hf)
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        out = ours.logits(ours(ids, attention_mask=mask))
    assert_float32_forwards(ours, hf, ids, mask, ref, out)


@pytest.mark.parametrize("family", ["llama3-rope", "qwen3-qknorm", "qwen2-bias-tied", "mixtral", "qwen3-moe"])
def test_family_switches_really_change_the_model(family: str) -> None:
    """The reference comparison would be vacuous if a switch were parsed but ignored."""
    raw = FAMILIES[family]
    cfg = ModelConfig.from_dict(hf_model(raw).config.to_dict())
    if family == "llama3-rope":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    if family == "qwen3-qknorm":
        assert cfg.qk_norm and cfg.head_dim == 24 != cfg.hidden_size // cfg.num_attention_heads
    if family == "qwen2-bias-tied":
        assert cfg.attention_bias and cfg.tie_word_embeddings
    if family in ("mixtral", "qwen3-moe"):
        sparse = [type(layer.mlp).__name__ for layer in CausalLM(cfg).model.layers]
        assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
        assert sparse == (["SparseMoeBlock"] * 2 if family == "mixtral" else ["SparseMoeBlock", "MLP"])
        assert cfg.norm_topk_prob == (family == "mixtral")


@pytest.mark.parametrize("family", ["llama-gqa-untied", "qwen2-bias-tied", "qwen3-qknorm", "llama3-rope", "mixtral",
                                    "qwen3-moe", "phi3-longrope"])
def test_pagedrl_saves_transformers_loads(tmp_path, family: str) -> None:
    hf = hf_model(FAMILIES[family])
    ours = pagedrl_from(hf)
    save_checkpoint(ours, tmp_path / "ckpt")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids, mask = padded_batch(hf.config.vocab_size, seed=2)
    with torch.no_grad():
        ref = back(input_ids=ids, attention_mask=mask).logits
        out = ours.logits(ours(ids, attention_mask=mask))
    assert_float32_forwards(ours, back, ids, mask, ref, out)


@pytest.mark.parametrize("family", ["smollm2-like", "mistral", "llama-linear-rope", "mixtral", "qwen3-moe",
                                    "phi3-longrope"])
def test_transformers_saves_sharded_pagedrl_loads(tmp_path, family: str) -> None:
    hf = hf_model(FAMILIES[family])
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_causal_lm(tmp_path / "hf")
    ids, mask = padded_batch(hf.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        out = ours.logits(ours(ids, attention_mask=mask))
    assert_float32_forwards(ours, hf, ids, mask, ref, out)


def test_pagedrl_sharded_save_round_trips(tmp_path) -> None:
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    ours = pagedrl_from(hf)
    save_checkpoint(ours, tmp_path / "ckpt", max_shard_bytes=30_000)
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) > 1
    back = load_causal_lm(tmp_path / "ckpt")
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_float32_weights_start_on_a_cache_line(tmp_path) -> None:
    """A float32 checkpoint's tensors stay in the dtype they are stored in, so they are the buffers
    safetensors reads them into, which start off a 64-byte line: each is moved to one that starts on a line."""
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_causal_lm(tmp_path / "hf", dtype=torch.float32)
    weights = [t for t in ours.state_dict().values() if t.is_floating_point() and t.numel()]
    assert weights and all(t.dtype == torch.float32 and t.data_ptr() % 64 == 0 for t in weights)
    mine = ours.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, mine[name]), name
