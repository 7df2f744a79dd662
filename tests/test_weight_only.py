"""int8 / int4 weight-only quantization made at load (`model/weight_only.py`): the stored values are the
rule's, checked against a float64 hand computation element by element (and against gguf's own decoder
of the block layouts); the quantized engine's tokens and log-probs are those of the float32 model whose
weights are the dequantized values; and what it cannot do is refused in one line."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from tiny import FAMILIES, hf_model

from pagedrl import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import products
from pagedrl.model.gguf_modules import GGUFEmbedding, GGUFLinear, dequantize
from pagedrl.model.loader import load_model
from pagedrl.model.routed import Linear
from pagedrl.model.weight_only import QuantizationError, int4_blocks, int8_blocks


def edge_weights() -> torch.Tensor:
    """Random rows, and rows / groups of 32 made to hit each case of the rules."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(10, 96, generator=g) * torch.logspace(-3, 2, 10)[:, None]
    w[1] = 0.0  # an all-zero row
    w[2, 32:64] = 0.0  # an all-zero group
    w[3, :32] = 0.75  # a constant group: int4 scale 0, every value the minimum
    w[4, 5] = 6.0e4  # one extreme value: the row's int8 scale near a half's largest
    w[5] *= 1e-9  # values whose scales are below a half's smallest subnormal: all rounded to zero
    w[6, :32] = torch.linspace(-1, 1, 32)  # exact ties of the rounding
    return w


def half(x: float) -> float:
    return float(np.float16(x))  # numpy's float64 -> float16: rounded once, to nearest even


def int8_by_hand(w: np.ndarray) -> np.ndarray:
    out = np.zeros(w.shape, dtype=np.float32)
    for i, row in enumerate(w):
        s = half(max(abs(float(v)) for v in row) / 127.0)
        for j, v in enumerate(row):
            q = 0 if s == 0 else min(127, max(-127, round(float(v) / s)))  # Python's round: ties to even
            out[i, j] = np.float32(s * q)
    return out


def int4_by_hand(w: np.ndarray) -> np.ndarray:
    out = np.zeros(w.shape, dtype=np.float32)
    for i, row in enumerate(w):
        for start in range(0, len(row), 32):
            group = [float(v) for v in row[start:start + 32]]
            m = half(min(group))
            d = half((max(group) - m) / 15.0)
            for j, v in enumerate(group):
                q = 0 if d == 0 else min(15, max(0, round((v - m) / d)))
                out[i, start + j] = np.float32(d * q + m)  # d * q + m exact in float64, rounded once
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_round_trip_is_the_rule_computed_by_hand(method: str) -> None:
    w = edge_weights()
    blocks, ggml_type, hand = ((int8_blocks(w), Q.Q8_0, int8_by_hand(w.double().numpy())) if method == "int8"
                               else (int4_blocks(w), Q.Q4_1, int4_by_hand(w.double().numpy())))
    kernel = dequantize(blocks, int(ggml_type), w.shape[1]).numpy()
    assert np.array_equal(kernel.view(np.uint32), hand.view(np.uint32))
    assert np.array_equal(gguf_dequantize(blocks.numpy(), ggml_type).reshape(w.shape), hand)
    assert not hand[1].any() and not hand[5].any()  # zero rows stay zero, scales below a half's reach give 0
    if method == "int8":
        assert hand[4, 5] == np.float32(half(6.0e4 / 127) * 127)
    else:
        assert not hand[2, 32:64].any() and (hand[3, :32] == np.float32(0.75)).all()


def assert_engine_equals_twin(llm: LLM, twin: torch.nn.Module, prompts: list[list[int]],
                              params: SamplingParams) -> None:
    """The quantized engine's tokens and log-probs are those of an engine on its float32 twin, both
    running the decode program."""
    quantized = outputs(llm, prompts, params)
    llm.close()
    plain = LLM.from_module(twin, eos_token_ids=[2])
    assert plain.engine.decode_path().startswith("decode steps as one program")
    assert quantized == outputs(plain, prompts, params)
    plain.close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("weight-only") / "tiny"
    hf_model(FAMILIES["qwen2-bias-tied"], seed=2).save_pretrained(folder)
    return folder


def dequantized_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The float32 model whose weights are `model`'s dequantized values (plain projections and embedding)."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        parent_name, _, child = name.rpartition(".")
        parent = twin.get_submodule(parent_name) if parent_name else twin
        if isinstance(model.get_submodule(parent_name) if parent_name else model, GGUFEmbedding):
            continue  # the embedding's own table: replaced with it
        if isinstance(module, GGUFEmbedding):
            setattr(parent, child, torch.nn.Embedding.from_pretrained(module.table.dequantized(), freeze=True))
        elif isinstance(module, GGUFLinear) and name != "lm_head":
            linear = Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight = torch.nn.Parameter(module.dequantized(), requires_grad=False)
            linear.bias = module.bias
            setattr(parent, child, linear)
    twin.lm_head = Linear(twin.model.embed_tokens.embedding_dim, twin.model.embed_tokens.num_embeddings,
                                   bias=False)
    head = model.lm_head.dequantized() if isinstance(model.lm_head, GGUFLinear) else model.lm_head.weight.detach()
    twin.lm_head.weight = twin.model.embed_tokens.weight if twin.config.tie_word_embeddings else \
        torch.nn.Parameter(head.clone(), requires_grad=False)
    return twin


def outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams, lora_request: list | None = None) -> list[tuple]:
    """Each sample's tokens and log-probs (`lora_request`: one adapter or None per prompt)."""
    with pytest.MonkeyPatch.context() as mp:  # the float32 engine's products on its kernel at any row count
        mp.setattr(products, "MAX_ROWS_FLOAT", 1 << 30)
        result = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return [(c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
            for o in result for c in o.outputs]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_computes_the_dequantized_float32_model(tiny_folder: Path, method: str) -> None:
    loaded = load_model(str(tiny_folder), quantization=method)
    assert loaded.precision.dtype == torch.float32 and f"{method} weight-only" in loaded.precision.describe()
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    twin = dequantized_twin(loaded.model)
    ids = torch.tensor([[3, 40, 7, 99, 12, 5]])
    with torch.no_grad():
        assert torch.equal(loaded.model.logits(loaded.model(ids)), twin.logits(twin(ids)))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 200, size=n).tolist() for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    llm = LLM(str(tiny_folder), quantization=method, dtype="float32")
    assert llm.engine.decode_path().startswith("decode steps as one program")
    assert_engine_equals_twin(llm, twin, prompts, params)


def test_default_model_int4_greedy_and_bytes(default_model_dir: Path) -> None:
    """The default model: int4 holds under a fifth of its float32 bytes (int8 about a quarter), and its
    greedy tokens are those of the float32 model of its dequantized weights."""
    llm = LLM(quantization="int4", dtype="float32")
    model = llm.engine.model
    twin = dequantized_twin(model)
    float_bytes = sum(p.numel() * 4 for p in twin.parameters())  # each tensor once: the tied head is the embedding
    assert llm.engine.weight_bytes <= 0.2 * float_bytes
    prompts = [[1, 504, 3303, 314, 253, 1345, 30, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    assert_engine_equals_twin(llm, twin, prompts, params)


def test_refusals_are_one_clear_line(tiny_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported; supported: gguf, int8, int4, mxfp4, gptq, awq, "):
        load_model(str(tiny_folder), quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='int4' computes in float32 on a CPU.*dtype='bfloat16'"):
        load_model(str(tiny_folder), quantization="int4", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization='int8' with a LoRA adapter folded in is not supported"):
        load_model(str(tiny_folder), quantization="int8", adapter=str(tmp_path))
    odd = tmp_path / "odd"
    hf_model(dict(FAMILIES["llama-gqa-untied"], intermediate_size=100)).save_pretrained(odd)
    with pytest.raises(QuantizationError, match=r"quantization='int4': model.layers.0.mlp.down_proj.weight has 100 "
                                                r"inputs, which groups of 32 do not divide"):
        load_model(str(odd), quantization="int4")
    moe = tmp_path / "moe"
    hf_model(FAMILIES["mixtral"]).save_pretrained(moe)
    with pytest.raises(QuantizationError, match=r"quantization='int8' is not built for a mixture of experts"):
        load_model(str(moe), quantization="int8")
    with pytest.raises(QuantizationError, match=r"quantization='int8': w's scale 7.874e\+06 is beyond a half's range"):
        int8_blocks(torch.full((1, 32), 1.0e9), "w")
    with pytest.raises(QuantizationError, match="quantization='int4': w holds inf or NaN"):
        int4_blocks(torch.full((1, 32), float("nan")), "w")
