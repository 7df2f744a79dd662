"""DeepSeek-V3 / Kimi K2 GGUF files (llama.cpp's `deepseek2`), written here from random transformers models
as llama.cpp's converter writes them (one KV head, `kv_b_proj` cut into `attn_k_b` transposed per head and
`attn_v_b`, or whole as files from before that split; the correction bias as `exp_probs_b`; the shared
experts as `ffn_*_shexp`; YaRN's log multiplier): read back as the original model's tensors and logits,
quantized files as their dequantized values with the engine's greedy tokens transformers' `generate`, kept
quantized with the dequantized engine's tokens and log-probs; the two pre-tokenizers these files name
against the published regexes run by the `regex` module."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import regex
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import TOKENS, assert_file_follows, converted_as_the_original, write_tiny_gguf
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_engine import generate_both
from tiny import DEEPSEEK_FAMILIES, hf_model
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.checkpoint import load_causal_lm
from pagedrl.model.gguf import convert_gguf
from pagedrl.model.gguf_deepseek import deepseek_config, join_kv_b_state
from pagedrl.model.gguf_metadata import GGUFError, Metadata
from pagedrl.model.gguf_modules import GGUFExperts, GGUFLinear
from pagedrl.model.gguf_tokenizer import _pre_tokenizer
from pagedrl.model.loader import load_model

SIZES = dict(vocab_size=len(TOKENS), bos_token_id=0, eos_token_id=1, pad_token_id=None)
# (q_lora_rank and the experts' width 32: the blocks of Q8_0 and Q4 hold 32 values)
RAW = dict(DEEPSEEK_FAMILIES["deepseek-v3"], q_lora_rank=32, moe_intermediate_size=32, **SIZES)
# YaRN as DeepSeek-V3 publishes it (mscale = mscale_all_dim, which is all the file can say), queries
# without compression; the rotary pairs adjacent, as every deepseek2 file has them.
YARN = dict(DEEPSEEK_FAMILIES["deepseek-v3-yarn"], rope_interleave=True, **SIZES,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 0.7, "mscale_all_dim": 0.7,
                             "beta_fast": 32, "beta_slow": 1})
KEPT = {"attn_q_a": Q.Q8_0, "attn_q_b": Q.Q4_1, "attn_kv_a_mqa": Q.Q4_0, "attn_v_b": Q.Q8_0,
        "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.Q4_1,
        "ffn_gate_exps": Q.Q4_1, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q4_0,
        "ffn_gate_shexp": Q.Q8_0, "ffn_up_shexp": Q.Q4_1, "ffn_down_shexp": Q.Q4_0}


def deepseek_gguf(folder: Path, raw: dict[str, Any] = RAW, types: dict[str, Q] | None = None,
                  kv_b_split: bool = True) -> tuple[torch.nn.Module, Path]:
    hf = hf_model(raw, seed=5)
    return hf, write_tiny_gguf(folder / "deepseek.gguf", hf, arch="deepseek2", pre="deepseek-v3", add_bos=False,
                               types=types or {}, kv_b_split=kv_b_split)


@pytest.mark.parametrize(("raw", "kv_b_split"), [(RAW, True), (RAW, False), (YARN, True)],
                         ids=["split-kv_b", "whole-kv_b", "yarn-q_proj"])
def test_conversion_gives_back_the_original_model(raw: dict[str, Any], kv_b_split: bool, tmp_path: Path) -> None:
    """Float32 tensors: every one the original's (kv_b_proj put back together from its halves), the
    routing rule, latent sizes and YaRN in the config, and the logits within 1e-5."""
    hf, path = deepseek_gguf(tmp_path, raw, kv_b_split=kv_b_split)
    out, back = converted_as_the_original(path, tmp_path / "hf", hf)
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                  "topk_group", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                  "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "rope_interleave"):
        assert getattr(back.config, field) == getattr(hf.config, field), field
    assert {k: back.config.rope_parameters[k] for k in hf.config.rope_parameters} == hf.config.rope_parameters
    ours = load_causal_lm(out, dtype=torch.float32)
    ids = torch.randint(0, len(TOKENS), (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((ours.logits(ours(ids)) - hf(ids).logits).abs().max()) < 1e-5


def test_a_quantized_file_is_its_dequantized_model(tmp_path: Path) -> None:
    """Q8_0 and Q4 tensors, `attn_v_b` among them: each converted weight within its blocks' rounding of
    the original at the same place (a misplaced row would be off by the weights' own size), and the model
    of those weights in transformers against pagedrl's on the file: logits within 1e-5, the engine's
    greedy tokens transformers' `generate` (4-token blocks, 7-token chunks)."""
    hf, path = deepseek_gguf(tmp_path, types=KEPT)
    out = convert_gguf(path, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original, converted = hf.state_dict(), theirs.state_dict()
    assert sorted(converted) == sorted(original)
    for name, w in original.items():
        assert float((converted[name] - w).abs().max()) <= float(w.abs().max()) / 6, name
    assert_file_follows(path, tmp_path / "again", theirs, len(TOKENS), torch.randint(
        0, len(TOKENS), (2, 21), generator=torch.Generator().manual_seed(1)))


def test_kept_quantized_gives_the_dequantized_engines_tokens_and_logprobs(tmp_path: Path) -> None:
    """--quantization gguf on a file with every projection in Q8_0, Q4_0 or Q4_1: the experts kept as
    `GGUFExperts`, the shared experts and low-rank projections as `GGUFLinear`, kv_b_proj joined in float32,
    the correction bias a buffer; sampled and greedy tokens and log-probs the float32 engine's on the file."""
    hf, path = deepseek_gguf(tmp_path, types=KEPT)
    model = load_model(str(path), quantization="gguf").model
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts, GGUFExperts)
    assert all(isinstance(m, GGUFLinear) for m in (layer.mlp.shared_experts.down_proj, layer.self_attn.q_b_proj,
                                                   layer.self_attn.kv_a_proj_with_mqa, model.model.layers[0].mlp.up_proj))
    assert type(layer.self_attn.kv_b_proj) is not GGUFLinear and layer.self_attn.kv_b_proj.weight.dtype == torch.float32
    assert "e_score_correction_bias" in dict(layer.mlp.gate.named_buffers())
    assert torch.equal(layer.mlp.gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, len(TOKENS), size=n).tolist() for n in (4, 19, 11)]
    for params in (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=7, logprobs=0, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)):
        quantized, plain = generate_both(path, params, prompts, enforce_eager=True)
        assert quantized == plain


class _Fields(Metadata):
    """A header's fields without a file, for the refusals."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields, self.source = fields, "model.gguf"

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def test_what_cannot_be_read_is_refused_by_name() -> None:
    base = {"deepseek2.rope.dimension_count": 8, "deepseek2.attention.key_length_mla": 24,
            "deepseek2.attention.value_length_mla": 12, "deepseek2.expert_gating_func": 2}
    for gating in (1, None):  # DeepSeek-V2's softmax, and files from before the field
        with pytest.raises(GGUFError, match=r"model.gguf: deepseek2.expert_gating_func is .*DeepSeek-V2"):
            deepseek_config(_Fields({**base, "deepseek2.expert_gating_func": gating}), {})
    with pytest.raises(GGUFError, match=r"key_length_mla \(8\) must exceed deepseek2.rope.dimension_count"):
        deepseek_config(_Fields({**base, "deepseek2.attention.key_length_mla": 8}), {})
    yarn = {**base, "deepseek2.block_count": 2, "deepseek2.expert_count": 8, "deepseek2.rope.scaling.type": "yarn",
            "deepseek2.embedding_length": 64, "deepseek2.feed_forward_length": 96, "deepseek2.attention.head_count": 4,
            "deepseek2.attention.kv_lora_rank": 32, "deepseek2.expert_used_count": 2,
            "deepseek2.expert_feed_forward_length": 32}
    with pytest.raises(GGUFError, match=r"without deepseek2.rope.scaling.yarn_log_multiplier"):
        deepseek_config(_Fields(yarn), {"token_embd.weight": SimpleNamespace(shape=(64, 269))})
    with pytest.raises(GGUFError, match=r"layer 3 has attn_k_b without its other half"):
        join_kv_b_state({"blk.3.attn_k_b.weight": np.zeros((4, 32, 16), np.float32)}, None, "model.gguf")


def _byte_level(pieces: list[str]) -> list[str]:
    table = bytes_to_unicode()
    return ["".join(table[b] for b in piece.encode()) for piece in pieces]


def _isolated(pattern: str, pieces: list[str]) -> list[str]:
    """An "isolated" split: each match and each run between matches its own piece."""
    out = []
    for piece in pieces:
        at = 0
        for m in regex.finditer(pattern, piece, flags=regex.V1):
            out += [piece[at:m.start()]] if m.start() > at else []
            out.append(m.group())
            at = m.end()
        out += [piece[at:]] if at < len(piece) else []
    return out


# DeepSeek-V3's tokenizer.json (three splits in turn) and Kimi K2's tokenization_kimi.py, as published.
DEEPSEEK_V3 = [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
               "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
               "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]
KIMI_K2 = ["|".join([r"[\p{Han}]+",
                     r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
                     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                     r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
                     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                     r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])]
TEXT = st.lists(st.sampled_from([*"aZé'sT 09\n\t.,!?-_日本語世界カタナひらがな٣ñ\u0301😀", "'ll", "DON'T", "  "]),
                max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_deepseek_and_kimi_pre_tokenizers_split_as_the_published_regexes(text: str) -> None:
    for pre, patterns in (("deepseek-v3", DEEPSEEK_V3), ("kimi-k2", KIMI_K2)):
        ours = [piece for piece, _ in _pre_tokenizer(pre, "model.gguf")[0].pre_tokenize_str(text)]
        pieces = [text] if text else []
        for pattern in patterns:
            pieces = _isolated(pattern, pieces)
        assert ours == _byte_level(pieces), pre
