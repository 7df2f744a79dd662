"""gpt-oss GGUF files (llama.cpp's `gpt-oss`), written here from a random transformers model as llama.cpp's
converter writes one (gate and up split from their interleaving, the experts transposed to rows of outputs,
the sinks and router renamed, MXFP4 experts): read back as the original model's tensors and logits, the
MXFP4 experts as the model whose experts are their dequantized values, and the engine's greedy tokens as
transformers' `generate` on that model."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_files import TOKENS, assert_file_follows, write_tiny_gguf
from tiny import GPT_OSS_FAMILIES, hf_model

from pagedrl.model.checkpoint import load_causal_lm
from pagedrl.model.gguf import convert_gguf

# (a GGUF carries no SwiGLU clamp: llama.cpp's runtime clamps at 7, the published models' limit)
RAW = dict(GPT_OSS_FAMILIES["gpt-oss"], vocab_size=len(TOKENS), bos_token_id=0, eos_token_id=1, pad_token_id=None,
           swiglu_limit=7.0)
MXFP4 = {"ffn_gate_exps": Q.MXFP4, "ffn_up_exps": Q.MXFP4, "ffn_down_exps": Q.MXFP4}


def gpt_oss_gguf(folder: Path, types: dict[str, Q]) -> tuple[torch.nn.Module, Path]:
    hf = hf_model(RAW, seed=11)
    return hf, write_tiny_gguf(folder / "gpt-oss.gguf", hf, arch="gpt-oss", pre="gpt-4o", add_bos=False, types=types)


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, len(TOKENS), (2, 23), generator=torch.Generator().manual_seed(seed))


def test_conversion_gives_back_the_original_model(tmp_path: Path) -> None:
    """Float32 experts (llama.cpp writes unquantized ones as they are): every tensor the original's, the
    rules in the config, and the logits within 1e-5."""
    hf, path = gpt_oss_gguf(tmp_path, {})
    out = convert_gguf(path, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    for field in ("layer_types", "sliding_window", "rope_parameters", "num_local_experts", "num_experts_per_tok",
                  "head_dim", "intermediate_size", "swiglu_limit"):
        assert getattr(back.config, field) == getattr(hf.config, field), field
    ours = load_causal_lm(out, dtype=torch.float32)
    with torch.no_grad():
        assert float((ours.logits(ours(ids(0))) - hf(ids(0)).logits).abs().max()) < 1e-5


def test_mxfp4_experts_are_the_model_with_their_dequantized_values(tmp_path: Path) -> None:
    """MXFP4 experts (the published files' format): the model whose experts are those blocks' values,
    logits within 1e-5 and the engine's greedy tokens transformers' `generate` (kept quantized:
    tests/test_mxfp4_kept.py)."""
    hf, path = gpt_oss_gguf(tmp_path, MXFP4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # the rows llama.cpp quantizes
                rows = p.detach().numpy().transpose(0, 2, 1)
                back = dequantize(quantize(rows, Q.MXFP4), Q.MXFP4).reshape(rows.shape)
                p.copy_(torch.from_numpy(back.transpose(0, 2, 1).copy()))
    assert_file_follows(path, tmp_path / "hf", hf, len(TOKENS), ids(1))
