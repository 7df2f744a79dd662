"""GGUF weights kept quantized in the engine (`quantization="gguf"`): the model computes the float32 model
of the same file dequantized, bit for bit (logits outside the engine; tokens and log-probs through the
engine's decode program, its modules, chunked prefill and preemption), on every supported type, holds a
fraction of its float32 bytes, and refuses what it cannot do in one clear line."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import TINY, write_tiny_gguf
from tiny import hf_model

from pagedrl import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import products
from pagedrl.model.gguf import GGUFError
from pagedrl.model.gguf_modules import GGUFEmbedding, GGUFLinear
from pagedrl.model.loader import load_model

# Every supported type in one model; sizes that K-quants' 256-value blocks divide.
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0, "ffn_gate": Q.Q4_0,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_1, "token_embd": Q.Q8_0}
WIDE = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-types") / "types.gguf", hf_model(WIDE, seed=5), types=TYPES)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_default_model_kept_quantized_computes_the_float32_model(default_model_dir: Path) -> None:
    quantized = load_model(quantization="gguf")
    plain = load_model(dtype="float32")
    assert quantized.precision.dtype == torch.float32
    assert "Q4_1 x 210, Q8_0 x 1" in quantized.precision.describe()
    kinds = {type(m) for m in quantized.model.modules()}
    assert GGUFLinear in kinds and GGUFEmbedding in kinds and torch.nn.Linear not in kinds
    # the tied head multiplies the embedding's own blocks: no second copy
    assert quantized.model.lm_head.qweight.data_ptr() == quantized.model.model.embed_tokens.table.qweight.data_ptr()
    ids = torch.tensor([[1, 504, 3303, 314, 253, 1345, 30, 2]])
    with torch.no_grad():
        assert torch.equal(quantized.model.logits(quantized.model(ids)), plain.model.logits(plain.model(ids)))
    # Q4_1 projections and a Q8_0 embedding: under a fifth of the float32 model's bytes
    assert weight_bytes(quantized.model) <= 0.2 * weight_bytes(plain.model)


def generate_both(path: Path, params: SamplingParams, prompts: list[list[int]], **settings) -> list[tuple]:
    """The quantized engine's outputs and the float32 engine's on the file dequantized, that one with every
    step's products on its float32 kernel (the quantized kernel's sums, at any row count)."""
    outs = []
    for quantization in ("gguf", None):
        llm = LLM(str(path), quantization=quantization, dtype="float32", **settings)
        assert llm.engine.decode_path().startswith("decode steps as one program") != settings.get("enforce_eager", False)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(products, "MAX_ROWS_FLOAT", 1 << 30)
            result = llm.generate(prompts, params, use_tqdm=False)
        outs.append([(c.token_ids, c.logprobs and [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
                     for o in result for c in o.outputs])
        llm.close()
    return outs


# The engine's two ways through a quantized model: its CPU decode program, and its modules with chunked
# prefill and preemption.
ENGINE_PATHS = pytest.mark.parametrize("settings", [
    dict(),
    dict(enforce_eager=True, max_num_batched_tokens=24, kv_cache_tokens=160, max_num_seqs=6),
], ids=["program", "eager-chunked-preempted"])


@ENGINE_PATHS
def test_engine_tokens_and_logprobs_equal_the_dequantized_engine(every_type_gguf: Path, settings: dict) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, WIDE["vocab_size"], size=n).tolist() for n in (3, 17, 40, 9, 28, 33, 5, 12)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, logprobs=0, ignore_eos=True)
    quantized, plain = generate_both(every_type_gguf, params, prompts, **settings)
    assert quantized == plain
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    quantized, plain = generate_both(every_type_gguf, greedy, prompts, **settings)
    assert quantized == plain


def test_every_supported_type_is_kept(every_type_gguf: Path) -> None:
    loaded = load_model(str(every_type_gguf), quantization="gguf")
    kinds = {m.ggml_type for m in loaded.model.modules() if isinstance(m, GGUFLinear)}
    assert kinds == {int(t) for t in TYPES.values()}


def test_without_the_kernels_the_torch_dequantizer_gives_the_same_model(every_type_gguf: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU kernels are not built (and on CUDA) the weights are dequantized by `model/gguf_dequant.py`:
    the same values, so the same logits as the float32 model of the file."""
    from pagedrl.kernels import ops

    quantized = load_model(str(every_type_gguf), quantization="gguf").model
    plain = load_model(str(every_type_gguf), dtype="float32").model
    ids = torch.tensor([[3, 40, 7, 99, 12, 5]])
    monkeypatch.setattr(ops, "available", lambda: False)
    with torch.no_grad():
        assert torch.equal(quantized.logits(quantized(ids)), plain.logits(plain(ids)))
        bf16 = quantized.to(torch.bfloat16)
        assert bf16.model.embed_tokens(ids).dtype == torch.bfloat16
        assert bf16.logits(bf16(ids)).isfinite().all()


def test_refusals_are_one_clear_line(every_type_gguf: Path, default_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported; supported: gguf"):
        load_model(quantization="fp8")
    with pytest.raises(ValueError, match="needs a GGUF file; .* is a folder"):
        load_model(str(default_model_dir), quantization="gguf")
    with pytest.raises(ValueError, match="computes in float32 on a CPU"):
        load_model(str(every_type_gguf), quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="LoRA adapter folded in"):
        load_model(str(every_type_gguf), quantization="gguf", adapter=str(tmp_path))
    # a quant type that is not kept quantized: named, with the supported list
    path = tmp_path / "q2k.gguf"
    reader = gguf.GGUFReader(every_type_gguf)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_down.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            raw = np.random.default_rng(0).integers(0, 256, (rows, cols // 256 * 84), dtype=np.uint8)
            writer.add_tensor(t.name, raw, raw_dtype=Q.Q2_K)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_down.weight' is Q2_K, which quantization='gguf' does not keep "
                                        r"quantized \(supported: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4\)"):
        load_model(str(path), quantization="gguf")
