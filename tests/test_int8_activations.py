"""`activations="int8"`: a quantized model's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K projections
multiply 8-bit activations in the engine, as llama.cpp computes them. The engine's greedy tokens and log-probs (through
its decode program, and through its modules with chunked prefill and preemption) against a reference that
runs the same model token by token with every such projection computed by hand in float64
(`test_gguf_int8.by_hand`, `test_gguf_int8_kquants.by_hand`): the same tokens up to the first near tie,
log-probs within float32 rounding but for a rounding flip (below) in at most one prompt in three; every
product of the modules' run against the hand sum on its own input rows; the start-up line says it; refusals.

A rounding flip: a float32 sum in another order (the kernels' against the hand sums, attention summed in
chunks) gives a row's inputs an ulp or so off the reference's, and an activation that sits on a rounding
boundary of the 8 bits rounds the other way (or, for a K-quant's block of 256, the block's largest value
moves its scale); one such value moves a log-prob by up to about 1e-3, and a flip in a prompt's keys
stays for every later step. The modules' run shows the products themselves exact: each call equals the
hand sum of its own rows within float32 rounding."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import TINY, write_tiny_gguf
from test_gguf_engine import ENGINE_PATHS
from test_gguf_int8 import by_hand
from test_gguf_int8_kquants import by_hand as k_by_hand
from tiny import hf_model

from pagedrl import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import ops
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.gguf_rows8 import ROWS8, unpack_rows8
from pagedrl.model.loader import load_model

TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q5_0,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q6_K, "blk.1.ffn_down": Q.Q4_K, "token_embd": Q.Q8_0}
WIDE = dict(TINY, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True)
NEAR_TIE = 2e-3  # the reference's top-two logit gap under which the two sides may pick differently
FLIP = 3e-3  # what one activation rounded the other way can move a log-prob by (at most 1 prompt in 3)
PROMPTS = (3, 17, 40, 9, 28, 33)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def int8_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-int8") / "int8.gguf", hf_model(WIDE, seed=11), types=TYPES)


def by_hand_forward(self: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
    """A projection on 8-bit activations, in float64 by hand (the reference's)."""
    rows = x.detach().reshape(-1, x.shape[-1]).float().numpy()
    bias = None if self.bias is None else self.bias.detach().numpy()
    out, _ = hand_sum(rows, self.qweight.numpy(), Q(self.ggml_type), bias)
    return torch.from_numpy(out).float().view(*x.shape[:-1], self.out_features)


def reference(path: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[float]]]:
    """Greedy decoding of each prompt by whole forwards (no cache): its tokens, their log-probs and each
    step's top-two logit gap."""
    model = load_model(str(path), quantization="gguf").model
    out = []
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(GGUFLinear, "forward", by_hand_forward)
        for prompt in prompts:
            ids, logprobs, gaps = list(prompt), [], []
            for _ in range(NEW_TOKENS):
                logits = model.logits(model(torch.tensor([ids])))[0, -1].double()
                top = logits.topk(2).values
                token = int(logits.argmax())
                ids.append(token)
                logprobs.append(float(logits.log_softmax(-1)[token]))
                gaps.append(float(top[0] - top[1]))
            out.append((ids[len(prompt):], logprobs, gaps))
    return out


@ENGINE_PATHS
def test_engine_computes_llama_cpp_s_arithmetic(int8_gguf: Path, settings: dict) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, WIDE["vocab_size"], size=n).tolist() for n in PROMPTS]
    llm = LLM(str(int8_gguf), quantization="gguf", activations="int8", **settings)
    assert llm.engine.decode_path().startswith("decode steps as one program") != settings.get("enforce_eager", False)
    described = "8-bit activations (llama.cpp's arithmetic) for Q4_0 x 2, Q4_1 x 4, Q4_K x 1, Q5_0 x 2, Q5_1 x 2, Q6_K x 1, Q8_0 x 2"
    assert described in llm.precision.describe()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # the modules' products (a decode program calls the op itself)
        mp.setattr(ops, "gguf_linear_int8", functools.partial(checked_product, ops.gguf_linear_int8, calls))
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    assert calls  # prefill runs the modules on either path
    assert "rows8" in calls  # the Q4_0 / Q4_1 / Q4_K projections in the rows8 layout
    assert Q.Q6_K in calls and Q.Q4_K in calls  # the down projections on blocks of 256
    compared, flipped = 0, 0
    for out, (tokens, logprobs, gaps) in zip(got, reference(int8_gguf, prompts), strict=True):
        errors = []
        for step, want in enumerate(tokens):
            if out.token_ids[step] != want:
                assert gaps[step] < NEAR_TIE, (step, gaps[step])
                break
            errors.append(abs(out.logprobs[step][want].logprob - logprobs[step]))
            assert errors[-1] < FLIP, (step, errors[-1])
        compared += len(errors)
        flipped += max(errors, default=0) > 1e-4  # a flip in the prompt's keys stays for every later step
    assert compared >= len(PROMPTS) * NEW_TOKENS * 3 // 4  # near ties are rare: most tokens were compared
    assert flipped <= len(PROMPTS) // 3, flipped


def checked_product(product, calls: list, x, blocks, ggml_type, k, bias):  # noqa: ANN001, ANN201
    """`product`'s result, asserted equal to the hand sum over the same rows within float32 rounding."""
    out = product(x, blocks, ggml_type, k, bias)
    if ggml_type >= ROWS8:  # a Q4_0 / Q4_1 / Q4_K weight kept in the rows8 layout
        ggml_type -= ROWS8
        blocks = unpack_rows8(blocks, ggml_type)
        calls.append("rows8")
    want, scale = hand_sum(x.numpy(), blocks.numpy(), Q(ggml_type), None if bias is None else bias.numpy())
    bound = 4 * np.finfo(np.float32).eps * (k // 32 + 2) * scale + np.finfo(np.float32).tiny
    calls.append(Q(ggml_type))
    assert (np.abs(out.numpy() - want) <= bound).all(), (Q(ggml_type), tuple(x.shape))
    calls.append(tuple(x.shape))
    return out


def hand_sum(x: np.ndarray, raw: np.ndarray, qtype: Q, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The hand sum (and its float32 bound's magnitudes) of either activation block size."""
    return (k_by_hand if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else by_hand)(x, raw, qtype, bias)


def test_int8_activations_change_the_numbers_within_their_rounding(int8_gguf: Path) -> None:
    """Not the float32 model's logits, but close to them (8-bit activations round each value by up to 1/254
    of its block's largest)."""
    int8 = LLM(str(int8_gguf), quantization="gguf", activations="int8")
    exact = LLM(str(int8_gguf), quantization="gguf")
    prompt = np.random.default_rng(4).integers(5, WIDE["vocab_size"], size=30).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    a, b = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0] for llm in (int8, exact))
    shared = set(a) & set(b)
    assert shared and any(a[t].logprob != b[t].logprob for t in shared)
    assert all(abs(a[t].logprob - b[t].logprob) < 0.05 for t in shared)


def test_refusals_are_one_clear_line(int8_gguf: Path, default_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"activations='int4' is not supported; supported: float32, int8"):
        load_model(str(int8_gguf), quantization="gguf", activations="int4")
    with pytest.raises(ValueError, match=r"needs quantization \(gguf, int8 or int4\) and a CPU device, got "
                                         r"quantization=None on cpu"):
        load_model(str(default_model_dir), activations="int8", device="cpu")
    with pytest.raises(ValueError, match=r"got quantization='gguf' on cuda"):
        load_model(str(int8_gguf), quantization="gguf", activations="int8", device="cuda")
    floats = write_tiny_gguf(tmp_path / "f32.gguf", hf_model(WIDE, seed=1), types={})
    with pytest.raises(ValueError, match=r"has no Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K projection to multiply "
                                         r"on 8-bit activations"):
        load_model(str(floats), quantization="gguf", activations="int8")
