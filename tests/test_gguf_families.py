"""GGUF files of the Qwen, Phi-3 and Mixtral families (llama.cpp's `qwen2`, `qwen3`, `qwen3moe`, `phi3`, and
`llama` with experts), written here
from random transformers models as llama.cpp's converter lays them out: the converted folder holds the
original model's very tensors (read back by transformers), transformers reading the GGUF itself gives
the same logits, and the engine keeps the file's quantized projections quantized with the tokens and
log-probs of the file dequantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import TINY, TOKENS, assert_float32_forwards, converted_as_the_original, write_tiny_gguf
from test_gguf_engine import generate_both
from tiny import FAMILIES as FAMILY_CONFIGS
from tiny import hf_model

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.checkpoint import load_causal_lm, read_folder_config
from pagedrl.model.gguf import GGUFError, convert_gguf
from pagedrl.model.gguf_modules import GGUFExperts
from pagedrl.model.loader import load_model

QWEN = dict(TINY, num_key_value_heads=2, tie_word_embeddings=True)
# name -> (llama.cpp architecture, transformers config)
FAMILIES = {
    "qwen2": ("qwen2", dict(QWEN, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("qwen3", dict(QWEN, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)),
    # head_dim 24 (not hidden / heads): the file says so in `attention.key_length`
    "qwen3-head24": ("qwen3", dict(QWEN, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=24)),
    # the second layer dense; llama.cpp renormalises the chosen experts' weights, so norm_topk_prob is true
    "qwen3-moe": ("qwen3moe", dict(QWEN, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=24,
                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   mlp_only_layers=[1], norm_topk_prob=True)),
    # Mixtral: a `llama` file with experts (q/k permuted, as llama.cpp's converter does there)
    "mixtral": ("llama", dict(FAMILY_CONFIGS["mixtral"], vocab_size=QWEN["vocab_size"], bos_token_id=0,
                              eos_token_id=1, pad_token_id=None)),
    "phi3-4k": ("phi3", dict(QWEN, architectures=["Phi3ForCausalLM"], model_type="phi3", tie_word_embeddings=False)),
    # Phi-3 with its fused projections, a partial rotation and LongRoPE (tests/tiny.py's)
    "phi3": ("phi3", dict(FAMILY_CONFIGS["phi3-longrope"], vocab_size=QWEN["vocab_size"], bos_token_id=0,
                          eos_token_id=1, pad_token_id=None)),
}
FLOAT32: dict[str, Q] = {}  # every tensor stored in float32: the conversion must give back the very weights


def family_gguf(name: str, folder: Path, types: dict[str, Q] | None = None) -> tuple[torch.nn.Module, Path]:
    arch, raw = FAMILIES[name]
    hf = hf_model(raw, seed=11)
    return hf, write_tiny_gguf(folder / f"{name}.gguf", hf, arch=arch, pre="qwen2", add_bos=False,
                               types=FLOAT32 if types is None else types,
                               pad_token_id=1 if arch == "phi3" else None)  # (else transformers' Phi-3 pads with 32000)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_conversion_gives_back_the_original_model(name: str, tmp_path: Path) -> None:
    hf, path = family_gguf(name, tmp_path)
    out, back = converted_as_the_original(path, tmp_path / "hf", hf)
    cfg = read_folder_config(out)
    assert cfg.architecture == FAMILIES[name][1]["architectures"][0]
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert cfg.head_dim == head_dim and cfg.qk_norm == name.startswith("qwen3")
    assert back.config.rope_parameters == hf.config.rope_parameters
    ours = load_causal_lm(out)
    ids = torch.randint(0, len(TOKENS), (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_float32_forwards(ours, hf, ids, hf(ids).logits, ours.logits(ours(ids)))


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi3-4k"])
def test_transformers_reading_the_gguf_gives_the_same_logits(name: str, tmp_path: Path) -> None:
    """transformers' own GGUF reader (which does not read `attention.key_length`, hence the plain head
    size here) on a file with Q8_0 projections: its model and pagedrl's computes the same function."""
    _, path = family_gguf(name, tmp_path, types={"ffn_up": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0})
    direct = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    ours = load_causal_lm(convert_gguf(path, tmp_path / "hf"))
    ids = torch.randint(0, len(TOKENS), (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_float32_forwards(ours, direct, ids, direct(ids).logits, ours.logits(ours(ids)))


@pytest.mark.parametrize("name", ["qwen2", "qwen3-head24", "phi3", "qwen3-moe", "mixtral"])
def test_engine_kept_quantized_gives_the_dequantized_engines_tokens(name: str, tmp_path: Path) -> None:
    """Projections in Q8_0, Q4_0 and Q4_1, q and k among them (unpermuted in these architectures; Phi-3's
    fused qkv and gate-up; the mixtures' experts, each a slice of one tensor a projection): the quantized
    engine's sampled and greedy tokens and log-probs are the float32 engine's on the same file (Phi-3's
    and the mixtures' through the modules: they have no CPU decode program)."""
    _, path = family_gguf(name, tmp_path, types={"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1,
                                                 "attn_qkv": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
                                                 "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0,
                                                 "ffn_gate_exps": Q.Q4_1, "ffn_up_exps": Q.Q8_0,
                                                 "ffn_down_exps": Q.Q4_0})
    settings = {} if name in ("qwen2", "qwen3-head24") else dict(enforce_eager=True)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, len(TOKENS), size=n).tolist() for n in (3, 17, 30, 9)]
    for params in (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, logprobs=0, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)):
        quantized, plain = generate_both(path, params, prompts, **settings)
        assert quantized == plain


def test_experts_are_kept_quantized_and_mixed_types_refused_by_name(tmp_path: Path) -> None:
    _, path = family_gguf("qwen3-moe", tmp_path, types={"ffn_gate_exps": Q.Q4_1, "ffn_up_exps": Q.Q4_1,
                                                        "ffn_down_exps": Q.Q8_0})
    quantized, plain = load_model(str(path), quantization="gguf").model, load_model(str(path)).model
    experts = quantized.model.layers[0].mlp.experts
    assert isinstance(experts, GGUFExperts) and experts.num_experts == 8
    assert not isinstance(quantized.model.layers[1].mlp, type(quantized.model.layers[0].mlp))  # the dense layer
    ids = torch.tensor([[3, 40, 7, 99, 12, 5, 61, 8]])
    with torch.no_grad():
        assert torch.equal(quantized.logits(quantized(ids)), plain.logits(plain(ids)))
    (tmp_path / "mixed").mkdir()
    _, mixed = family_gguf("qwen3-moe", tmp_path / "mixed", types={"ffn_gate_exps": Q.Q4_1})
    with pytest.raises(GGUFError, match=r"model.layers.0.mlp.experts: experts of types ffn_down_exps F32, "
                                        r"ffn_gate_exps Q4_1, ffn_up_exps F32"):
        load_model(str(mixed), quantization="gguf")
