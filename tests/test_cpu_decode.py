"""bf16 and float32 decode steps as one straight run of the kernels (`engine/cpu_decode.py`): the same
tokens and the same log-probs, bit for bit, as the decoder's modules routed to the same kernels
(`enforce_eager=True`), for every family; a step's layers in one kernel call
(`ops.decode_layers`) give the program's Python loop's bits for every kind of projection; the program
follows weights written in place and a weight-version bump; what it does not cover runs through the
modules."""

from __future__ import annotations

import pytest
import torch
from cpu_class import needs, needs_not
from gguf import GGMLQuantizationType as Q
from gguf_files import TINY, write_tiny_gguf
from test_engine_precision import peaked
from tiny import BASE, FAMILIES, FUSED_FAMILIES, GEMMA_FAMILIES, MOE_FAMILIES, hf_model

from pagedrl.engine import cpu_decode
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import ops, products
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.lora import LoRAConfig, apply_lora

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)


def engines(model: torch.nn.Module) -> tuple[LLM, LLM, list[int]]:
    """An engine with the program and one without, on the same module (no prefix caching: every
    prompt computed under the weights of its call), and a counter of the program's steps."""
    args = dict(kv_cache_tokens=512, max_num_batched_tokens=37, enable_prefix_caching=False)
    llm = LLM.from_module(model, **args)
    eager = LLM.from_module(model, enforce_eager=True, **args)
    assert eager.engine.runner.program is None
    assert eager.engine.runner.decode_path().startswith("decode steps through the model's modules")
    assert ("one program" in llm.engine.runner.decode_path()) == (llm.engine.runner.program is not None)
    program = llm.engine.runner.program
    steps: list[int] = []
    if program is not None:
        run = program.run

        def counted(input_ids, meta):  # noqa: ANN001, ANN202
            steps.append(input_ids.shape[0])
            return run(input_ids, meta)

        program.run = counted
    return llm, eager, steps


def needs_program(dtype: torch.dtype) -> None:
    """The bf16 program runs on the k-pairs kernels: AVX512-BF16 without AMX (with AMX, the modules
    on the tile kernel; below AVX512-BF16, the modules on torch's kernels). The float32 one runs on
    every class the kernels build for."""
    assert ops.available()
    if dtype == torch.bfloat16:
        needs("avx512_bf16", "the bf16 decode program")
        needs_not("amx", "the bf16 decode program")
        assert products.pairs_available()


DTYPES = [torch.bfloat16, torch.float32]


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].processed_logprobs, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_program_gives_the_modules_bits(family, dtype) -> None:
    """Biases (llama-mha-tied-bias, qwen2), q/k norms (qwen3), tied heads, GQA and MHA: every decode
    step of a mixed batch (prompts of 3 to 45 tokens, chunked at 37) runs the program where the
    kernels are built, and its tokens, log-probs and top alternatives equal the modules'. A mixture
    of experts (mixtral, qwen3-moe) and fused projections (phi3) are not the program's: their steps
    run through the modules."""
    needs_program(dtype)
    model = peaked(family, 3).to(dtype)
    prompts = [torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 45, 18)]
    llm, eager, steps = engines(model)
    assert outputs(llm, prompts) == outputs(eager, prompts)
    if family in MOE_FAMILIES:
        assert llm.engine.runner.program is None and not steps
        assert "sparse layers run as modules" in llm.engine.runner.decode_path()
        return
    if family in FUSED_FAMILIES:
        assert llm.engine.runner.program is None and not steps
        assert "fused qkv_proj and gate_up_proj" in llm.engine.runner.decode_path()
        return
    assert steps and max(steps) == len(prompts) and min(steps) >= 1


SCALED_ROPES = {  # the rope settings that scale cos and sin, on a family the program runs
    "qwen3-yarn": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2,
                       head_dim=24, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                     "original_max_position_embeddings": 32}),
    "llama-longrope": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=2,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32,
                                            "short_factor": [1.0 + i / 10 for i in range(8)],
                                            "long_factor": [2.0 + i / 2 for i in range(8)]}),
}


@pytest.mark.parametrize("rope", sorted(SCALED_ROPES))
def test_the_program_scales_the_rotation_as_the_modules_do(rope) -> None:
    """YaRN's attention factor and LongRoPE's two frequency sets (the long one from position 32 on,
    which the 45-token prompt's decode steps are past): the program's decode steps equal the
    modules' (they lost YaRN's factor and failed on LongRoPE's two sets)."""
    needs_program(torch.float32)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(SCALED_ROPES[rope])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    prompts = [torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 45, 18)]
    llm, eager, steps = engines(model)
    assert outputs(llm, prompts) == outputs(eager, prompts)
    assert steps and llm.engine.runner.program is not None


ONE_CALL_CASES = {  # the projections' kinds each case's steps take (`cpu_decode.Kind`)
    "qwen3-qknorm float_linear": {cpu_decode.Kind.FLOAT_LINEAR},
    "mistral-window float_linear": {cpu_decode.Kind.FLOAT_LINEAR},
    "qwen2-bias-tied float_gemm": {cpu_decode.Kind.FLOAT_GEMM},
    "llama-mha-tied-bias torch_linear": {cpu_decode.Kind.TORCH_LINEAR},
    "gguf int8": {cpu_decode.Kind.INT8},
    "gguf float32": {cpu_decode.Kind.GGUF},
    "smollm2-like bf16": {cpu_decode.Kind.PAIRS, cpu_decode.Kind.GATE_UP},
    "qwen2-bias-tied bf16": {cpu_decode.Kind.PAIRS, cpu_decode.Kind.GATE_UP},
}


@pytest.mark.parametrize("case", sorted(ONE_CALL_CASES))
def test_the_layers_in_one_call_give_the_loop_s_bits(case, tmp_path, monkeypatch) -> None:
    """A step's layers as one `decode_layers` call against the program's own Python loop over the same
    kernels: the same tokens, log-probs and alternatives, bit for bit, with biases, q/k norms (qwen3), a
    sliding window of 8 positions (mistral), float32 weights on each of the three products a step's row
    count picks, GGUF weights on 8-bit and on float32 activations (q, k and v, gate and up, in one call
    each on 8-bit ones), and bf16 weights' k-pairs copies (gate and up in one pass)."""
    name, kind = case.split(" ")
    needs_program(torch.bfloat16 if kind == "bf16" else torch.float32)
    if name == "gguf":
        types = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q8_0,
                 "ffn_up": Q.Q5_0, "ffn_down": Q.Q6_K}
        path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_model(dict(TINY, hidden_size=128, intermediate_size=256,
                                                                        num_attention_heads=4), seed=3), types=types)
        settings = dict(quantization="gguf", activations="int8" if kind == "int8" else "float32")
        make = lambda: LLM(str(path), kv_cache_tokens=512, enable_prefix_caching=False, **settings)  # noqa: E731
        vocab = 200
    else:
        if kind == "float_gemm":  # every step above the row-wise kernel's rows
            monkeypatch.setattr(products, "MAX_ROWS_FLOAT", 0)
        if kind == "torch_linear":  # and above the tiles' too
            monkeypatch.setattr(products, "MAX_ROWS_FLOAT", 0)
            monkeypatch.setattr(products, "MAX_ROWS_GEMM", 0)
        monkeypatch.setitem(FAMILIES, "mistral-window", dict(FAMILIES["mistral"], sliding_window=8))
        model = peaked(name, 6).to(torch.bfloat16 if kind == "bf16" else torch.float32)
        assert (model.config.uniform_window is not None) == (name == "mistral-window")
        make = lambda: LLM.from_module(model, kv_cache_tokens=512, enable_prefix_caching=False)  # noqa: E731
        vocab = 211
    prompts = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 12)]
    kinds, decode_layers = [], ops.decode_layers

    def counted(*args):  # noqa: ANN002, ANN202
        kinds.extend(args[7])
        return decode_layers(*args)

    monkeypatch.setattr(ops, "decode_layers", counted)
    one_call = outputs(make(), prompts)
    assert {cpu_decode.Kind(k) for k in kinds} == ONE_CALL_CASES[case]
    monkeypatch.setattr(cpu_decode, "flat_layers", lambda model, layers, bf16: None)  # the program's loop
    kinds.clear()
    assert outputs(make(), prompts) == one_call and not kinds


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_program_follows_weight_updates(dtype) -> None:
    """A weight written in place (its version counter moves) and one given new data under a
    weight-version bump are both read by the next step, as the modules read them."""
    needs_program(dtype)
    model = peaked("smollm2-like", 4).to(dtype)
    prompts = [[5, 9, 30, 31], list(range(40, 61))]
    llm, eager, steps = engines(model)
    before = outputs(llm, prompts)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-3)
    after = outputs(llm, prompts)
    assert after == outputs(eager, prompts) and after != before
    weight = model.model.layers[0].self_attn.v_proj.weight
    version = weight._version
    weight.data = weight.data * 2  # new data under the same counter: the bump is what tells
    assert weight._version == version
    llm.engine.bump_weight_version()
    bumped = outputs(llm, prompts)
    assert bumped == outputs(eager, prompts) and bumped != after
    assert len(steps) >= 3 * GREEDY.max_tokens - 3
    replaced = model.model.layers[-1].self_attn.o_proj
    replaced.weight = torch.nn.Parameter(replaced.weight.detach() * -1, requires_grad=False)  # a new tensor
    llm.engine.bump_weight_version()
    swapped = outputs(llm, prompts)
    assert swapped == outputs(eager, prompts) and swapped != bumped


def test_what_the_program_does_not_cover_runs_through_the_modules() -> None:
    """A LoRA layer (its own forward), a float16 model, a mixture of experts, Gemma's layer rules,
    `enforce_eager`: no program."""
    assert not cpu_decode.supports(peaked("mixtral", 5)) and not cpu_decode.supports(peaked("qwen3-moe", 5))
    for family in ("gemma2", "gemma3"):  # their layer rules (soft caps, sandwich norms, per-layer windows) even
        silu = ModelConfig.from_dict(dict(GEMMA_FAMILIES[family], hidden_activation="silu"))  # on a SiLU MLP
        assert not cpu_decode.supports(CausalLM(silu))
    model = peaked("llama-gqa-untied", 5)
    assert cpu_decode.supports(model) == ops.available()  # float32
    assert not cpu_decode.supports(peaked("llama-gqa-untied", 5).half())
    bf16 = model.to(torch.bfloat16)
    assert cpu_decode.supports(bf16) == products.pairs_available()
    lora = apply_lora(peaked("llama-gqa-untied", 5), LoRAConfig(r=4, target_modules=["q_proj"])).to(torch.bfloat16)
    assert not cpu_decode.supports(lora)
    assert LLM.from_module(lora, kv_cache_tokens=256).engine.runner.program is None
