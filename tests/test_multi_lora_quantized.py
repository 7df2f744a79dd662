"""Adapters per request on a base kept quantized (`enable_lora` with `quantization="int4"` or `"gguf"`): the
base's products stay on the block kernels and each request's adapter adds its own low-rank update, so a
batch mixing adapter A, adapter B and the bare base gives each request the very tokens and log-probs it
gets from the same adapters served on the float32 model of the base's dequantized weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from multi_lora_cases import pagedrl_adapter
from test_gguf_engine import every_type_gguf  # noqa: F401  (a fixture)
from test_weight_only import dequantized_twin, outputs, tiny_folder  # noqa: F401  (tiny_folder: a fixture)

from pagedrl import LLM, LoRARequest
from pagedrl.engine.multi_lora import LoRASlots, SlotLinear
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.checkpoint import save_checkpoint
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.loader import load_model


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny models' steps are a few small torch ops per projection (an adapter's update): on a shared
    2-core machine a second thread only waits at each op's barrier (an `index_add_` of a few rows
    measured 0.1 s at two threads against 3 us at one). The numbers compared do not depend on it: both
    sides of every comparison run in the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
LORA = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4)


def two_adapters(base: Path, root: Path) -> list[LoRARequest]:
    """A: rank 2 on o and up; B: rank 4 on every projection."""
    a = pagedrl_adapter(base, root / "a", 2, ["o_proj", "up_proj"], seed=1)
    b = pagedrl_adapter(base, root / "b", 4, ["all-linear"], seed=2)
    return [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]


def mixed_batch(loras: list[LoRARequest], vocab: int) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Prompts of 3 to 40 tokens, each under A, B and the base, interleaved in one batch."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, vocab, size=n).tolist() for n in (3, 17, 40)]
    return [p for p in prompts for _ in range(3)], [*loras, None] * len(prompts)


def assert_each_request_as_on_the_twin(quantized: LLM, twin: LLM, loras: list[LoRARequest], vocab: int) -> list:
    """The quantized engine's outputs of the mixed batch, checked against the twin's; returned."""
    layers = quantized.engine.lora.layers
    assert layers and all(type(layer.base) is GGUFLinear for layer in layers.values())
    prompts, chosen = mixed_batch(loras, vocab)
    got = outputs(quantized, prompts, PARAMS, chosen)
    want = outputs(twin, prompts, PARAMS, chosen)
    assert got == want
    by_choice = [tuple(tuple(tokens) for tokens, _ in got[i::3]) for i in range(3)]
    assert len(set(by_choice)) == 3, by_choice  # A, B and the base each generate their own
    return got


def test_int4_base_serves_each_request_its_adapter(tiny_folder: Path, tmp_path: Path) -> None:  # noqa: F811
    loras = two_adapters(tiny_folder, tmp_path)
    quantized = LLM(str(tiny_folder), quantization="int4", **LORA)
    twin = save_checkpoint(dequantized_twin(load_model(str(tiny_folder), quantization="int4").model), tmp_path / "twin")
    vocab = quantized.engine.model.config.vocab_size
    got = assert_each_request_as_on_the_twin(quantized, LLM(str(twin), **LORA), loras, vocab)
    # the base's requests: the very numbers of an engine built without enable_lora (its decode program)
    plain = LLM(str(tiny_folder), quantization="int4", dtype="float32")
    assert outputs(plain, mixed_batch(loras, vocab)[0][2::3], PARAMS) == got[2::3]


def test_gguf_base_kept_quantized_serves_each_request_its_adapter(every_type_gguf: Path,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    loras = two_adapters(every_type_gguf, tmp_path)
    quantized = LLM(str(every_type_gguf), quantization="gguf", **LORA)
    vocab = quantized.engine.model.config.vocab_size
    assert_each_request_as_on_the_twin(quantized, LLM(str(every_type_gguf), **LORA), loras, vocab)


def test_a_projection_of_another_kind_is_refused_by_name() -> None:
    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(4)
    model.q_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"^enable_lora: q_proj is a Identity; adapters per request are built on"):
        LoRASlots(model)
    model.q_proj = torch.nn.Linear(4, 4)
    assert type(LoRASlots(model).layers["q_proj"]) is SlotLinear
