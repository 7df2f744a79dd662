"""gpt-oss's MXFP4 experts kept quantized (`quantization="mxfp4"` for a published checkpoint, `"gguf"` for a
llama.cpp file): the blocks' values are transformers' and gguf's dequantization bit for bit, the kernel's
products are the dequantized weight's, and a tiny model kept so decodes the dequantized model's greedy tokens
with its log-probs, in fewer bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf_files import TOKENS
from test_engine_greedy import prompts
from test_gguf_gpt_oss import MXFP4, gpt_oss_gguf
from test_gpt_oss import RAW, mxfp4_checkpoint
from tiny import FAMILIES, hf_model

from pagedrl import LLM, SamplingParams
from pagedrl.kernels import ops
from pagedrl.model import gguf_dequant
from pagedrl.model.expert_lora import apply_expert_lora
from pagedrl.model.loader import load_model
from pagedrl.model.mxfp4_experts import MXFP4_TYPE, MXFP4Experts, hf_rows, kept_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def random_pair(seed: int, experts: int = 2, rows: int = 48, groups: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers-layout blocks (every byte, so every nibble in both halves) and every scale 0..255."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=g, dtype=torch.uint8)
    blocks.view(-1, 16)[:16] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    scales = torch.arange(experts * rows * groups, dtype=torch.int32).remainder(256).to(torch.uint8)
    return blocks, scales.view(experts, rows, groups)


def test_blocks_dequantize_as_transformers_and_gguf_bit_for_bit() -> None:
    """The relaid rows, dequantized by the kernel and by torch, against transformers' function (equal as
    numbers: its E2M1 table has a -0 where gguf's has +0) and gguf's (the same float32 bits), every scale
    from 2^-127 (subnormal products) to 2^128 (inf) included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_pair(0)
    rows = hf_rows(blocks, scales)  # [E, rows, groups · 17]
    ref_hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, rows, in]
    ref_gguf = torch.from_numpy(gguf_dequantize(rows.numpy(), Q.MXFP4).reshape(ref_hf.shape))
    flat = rows.reshape(-1, rows.shape[-1])
    got = {"torch": gguf_dequant.dequantize(flat, MXFP4_TYPE, 96)}
    if ops.available():
        got["kernel"] = ops.gguf_dequantize(flat, MXFP4_TYPE, 96)
    for how, values in got.items():
        values = values.view(ref_hf.shape)
        assert torch.equal(values.view(torch.int32), ref_gguf.view(torch.int32)), how
        assert torch.equal(values, ref_hf), how
        assert bool(values.isinf().any()) and bool((values.abs() == 2.0 ** -128).any())


@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_kernel_product_is_the_dequantized_product(m: int) -> None:
    """x @ Wᵀ from the blocks: the bits `float_linear` gives on the dequantized weight, and within float32
    accumulation's bound of the float64 product, K · 2^-24 · Σ|x_k w_k| (K = 2880, gpt-oss's width)."""
    if not ops.available():  # asked here, not at collection, so the kernels load from the session's cache
        pytest.skip("needs the CPU kernels (a C++ compiler)")
    k, n = 2880, 48
    g = torch.Generator().manual_seed(m)
    blocks = torch.randint(0, 256, (1, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (1, n, k // 32), generator=g, dtype=torch.uint8)
    rows = hf_rows(blocks, scales)[0]
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    w = gguf_dequant.dequantize(rows, MXFP4_TYPE, k)
    got = ops.gguf_linear(x, rows, MXFP4_TYPE, k, bias)
    assert torch.equal(got, ops.float_linear(x, w, bias))
    exact = x.double() @ w.double().T + bias.double()
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_experts_without_kernels_dequantize_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (CUDA, no kernels) gives the kernel path's outputs to float32 rounding."""
    blocks, scales = random_pair(3, experts=3, rows=64, groups=2)
    down_b, down_s = random_pair(4, experts=3, rows=64, groups=1)
    scales, down_s = scales.remainder(8) + 120, down_s.remainder(8) + 120
    experts = MXFP4Experts(hf_rows(blocks, scales), torch.randn(3, 64), hf_rows(down_b, down_s), torch.randn(3, 64),
                           alpha=1.702, limit=7.0)
    x = torch.randn(5, 64)
    chosen, weights = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]]), torch.full((5, 2), 0.5)
    fast = experts(x, chosen, weights)
    monkeypatch.setenv("PAGEDRL_CPU_KERNELS", "0")
    slow = experts(x, chosen, weights)
    assert float((fast - slow).abs().max()) <= 1e-4 * float(slow.abs().max())


def greedy(llm: LLM, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])


def assert_same_greedy(kept: LLM, dequantized: LLM, vocab: int) -> None:
    batch = prompts(vocab)[:4]
    (tokens, logps), (want, want_logps) = greedy(kept, batch), greedy(dequantized, batch)
    assert tokens == want
    assert float(np.abs(np.array(logps) - np.array(want_logps)).max()) < 1e-4


def test_published_checkpoint_kept_decodes_the_dequantized_greedy(tmp_path: Path) -> None:
    """quantization="mxfp4": the engine's greedy tokens and log-probs are the dequantized float32 model's; the
    experts' blocks hold 17/128 of their float32 bytes (7.5x fewer) and the model's weight bytes shrink."""
    folder = tmp_path / "gpt-oss"
    mxfp4_checkpoint(folder, hf_model(RAW))
    kept = LLM(str(folder), quantization="mxfp4", block_size=4, max_num_batched_tokens=7)
    model = kept.engine.model
    assert isinstance(model.model.layers[0].mlp.experts, MXFP4Experts)
    held, floats = kept_bytes(model)
    assert held * 128 == floats * 17
    dequantized = LLM(str(folder), dtype="float32", block_size=4, max_num_batched_tokens=7)
    assert floats - held == dequantized.engine.weight_bytes - kept.engine.weight_bytes
    assert_same_greedy(kept, dequantized, RAW["vocab_size"])
    with pytest.raises(ValueError, match=r"gate_up_blocks is kept in MXFP4"):
        apply_expert_lora(model, ["gate_up_proj"], r=2, lora_alpha=4)
    kept.close()
    dequantized.close()


def test_gguf_file_kept_decodes_the_dequantized_greedy(tmp_path: Path) -> None:
    """quantization="gguf" on a gpt-oss file: its MXFP4 experts kept (gate and up rows interleaved), the
    greedy tokens and log-probs the file dequantized gives."""
    _, path = gpt_oss_gguf(tmp_path, MXFP4)
    kept = LLM(str(path), quantization="gguf", block_size=4, max_num_batched_tokens=7)
    assert isinstance(kept.engine.model.model.layers[1].mlp.experts, MXFP4Experts)
    dequantized = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7)
    assert kept.engine.weight_bytes < dequantized.engine.weight_bytes
    assert_same_greedy(kept, dequantized, len(TOKENS))
    kept.close()
    dequantized.close()


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    hf_model(FAMILIES["llama-gqa-untied"]).save_pretrained(folder)
    with pytest.raises(Exception, match=r"quantization='mxfp4' keeps gpt-oss's published MXFP4 experts; this is a llama"):
        load_model(str(folder), quantization="mxfp4")
    floats = tmp_path / "gpt-oss-float"
    hf_model(RAW).save_pretrained(floats)
    with pytest.raises(Exception, match=r"gate_up_proj_blocks' is missing"):
        load_model(str(floats), quantization="mxfp4")
    _, path = gpt_oss_gguf(tmp_path, {})
    with pytest.raises(ValueError, match=r"quantization='mxfp4'.* is not a folder"):
        load_model(str(path), quantization="mxfp4")
    with pytest.raises(Exception, match=r"ffn_.*_exps.weight' is F32; quantization='gguf' keeps gpt-oss's experts"):
        load_model(str(path), quantization="gguf")
    assert json.loads((floats / "config.json").read_text())["model_type"] == "gpt_oss"


def test_a_kept_model_that_cannot_fit_is_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check counts the experts as their blocks: refused, with the kept load named, where memory is short."""
    from pagedrl.model import footprint

    folder = tmp_path / "gpt-oss"
    mxfp4_checkpoint(folder, hf_model(RAW))
    monkeypatch.setattr(footprint, "available_bytes", lambda device: (1024, "a test's figure"))
    with pytest.raises(footprint.DoesNotFit, match=r"\(its MXFP4 experts kept\): the model needs"):
        load_model(str(folder), quantization="mxfp4")
