"""GPTQ folders whose modules are not all packed alike (`model/prequantized_config.py`): GPTQModel's
`dynamic` per-module rules, read as vLLM's `get_dynamic_override` reads them, and a head packed too
(`lm_head: true`, with GPTQModel's default head rule). The folders are written by GPTQModel's packers,
each module with the settings given to the writer explicitly (never pagedrl's regex matching): the held
weights are the float64 value of the codes packed, the engine's tokens and log-probs those of the
float32 model of the held weights, and what cannot be held exactly is refused naming the rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from prequantized_writers import write_packed
from safetensors import safe_open
from test_prequantized import held, rewrite
from test_weight_only import assert_engine_equals_twin, dequantized_twin

from pagedrl import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.checkpoint import CheckpointError
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.loader import load_model
from pagedrl.model.prequantized import Q8_0_OF_4BIT
from pagedrl.model.prequantized_config import PrequantizedError

FLOAT = "model.layers.1.mlp.up_proj"
DYNAMIC = {  # (the config's own: 4 bits, groups of 32, sym, no act-order); the first match wins
    rf"-:{FLOAT}": {},
    r"+:.*\.0\..*down_proj": {"bits": 8},
    r".*\.1\.self_attn\.q_proj": {"group_size": 64},
    r".*\.1\.mlp\.down_proj": {"desc_act": True},
    r"+:.*\.0\.mlp\.gate_proj": {"sym": False, "mse": 2.4},  # (a calibration setting: not read)
    r"+:.*\.0\.mlp\.": {"bits": 8},  # shadowed for gate_proj by the rule above
}
MODULES = {FLOAT: None, "model.layers.0.mlp.down_proj": dict(bits=8), "model.layers.0.mlp.up_proj": dict(bits=8),
           "model.layers.1.self_attn.q_proj": dict(group=64), "model.layers.1.mlp.down_proj": dict(desc_act=True),
           "model.layers.0.mlp.gate_proj": dict(symmetric=False)}
HEAD = {"lm_head": {"bits": 8, "group_size": 32, "sym": True, "desc_act": False, "mse": 2.4}}  # GPTQModel's default


def write(folder: Path, dynamic: dict = DYNAMIC, modules: dict = MODULES, **kwargs: object) -> dict[str, torch.Tensor]:
    return write_packed(folder, "gptq", 4, symmetric=True, modules=modules, config={"dynamic": dynamic}, **kwargs)


@pytest.mark.parametrize("case", ["dynamic", "lm_head"])
def test_each_module_is_its_own_codes_and_the_engine_their_float32_model(tmp_path: Path, case: str) -> None:
    folder = tmp_path / case
    if case == "dynamic":
        expected = write(folder)
        layouts = f"Q4_1 x 9, Q8_0 x 2, {Q8_0_OF_4BIT} x 1, float32 (dequantized at load: act-order groups) x 1"
    else:
        expected = write(folder, HEAD, {"lm_head": dict(bits=8)}, lm_head=True, vocab_size=256)
        layouts = "Q4_1 x 14, Q8_0 x 1"
    loaded = load_model(str(folder), device="cpu", load_tokenizer=False)
    assert f"gptq 4-bit weight-only, read from the checkpoint: {layouts};" in loaded.precision.describe()
    for name, weight in expected.items():
        assert torch.equal(held(loaded.model, name).double(), weight), name
    if case == "dynamic":  # the "-:" module: the file's float tensor
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert torch.equal(loaded.model.get_submodule(FLOAT).weight, f.get_tensor(f"{FLOAT}.weight").float())
    else:
        assert isinstance(loaded.model.lm_head, GGUFLinear)
    llm = LLM(str(folder), dtype="float32")
    twin = dequantized_twin(llm.engine.model)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, 200, size=n).tolist() for n in (4, 19, 33)]
    assert_engine_equals_twin(llm, twin, prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0,
                                                                 ignore_eos=True))


def refused(folder: Path, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_model(str(folder), device="cpu", load_tokenizer=False)


def test_what_the_rules_cannot_hold_is_refused_naming_the_rule(tmp_path: Path) -> None:
    folder = tmp_path / "gptq"
    write(folder)
    down = r"\+:\.\*\\\\\.0\\\\\.\.\*down_proj"  # (the key as an error's repr writes it)
    rules = {key: value for key, value in DYNAMIC.items() if key != r"+:.*\.0\.mlp\."}
    refused(rewrite(folder, tmp_path, dynamic=rules), CheckpointError,
            r"model.layers.0.mlp.up_proj.qweight has shape \(16, 96\), expected \(8, 96\): 4-bit codes of \[64\] "
            r"inputs \(quantization_config.bits = 4; a module packed otherwise needs a quantization_config.dynamic rule")
    for key, change, match in [
        (r"+:.*\.0\..*down_proj", {"bits": 4}, rf"down_proj.qweight .*\(quantization_config.dynamic\['{down}'\].bits"),
        (r"+:.*\.0\..*down_proj", {"bits": 8, "group_size": 16},
         rf"down_proj.scales has 3 groups; quantization_config.dynamic\['{down}'\].group_size = 16 gives 6"),
        (r"+:.*\.0\..*down_proj", {"bits": 8, "desc_act": True}, None),  # (act-order may be in order)
        (r".*\.1\.self_attn\.q_proj", {}, r"q_proj.scales has 1 groups; quantization_config.group_size = 32 gives 2"),
        (r".*\.1\.mlp\.down_proj", {},
         r"down_proj.g_idx puts inputs out of order \(act-order\) but quantization_config.desc_act is false"),
        (r"+:.*\.0\.mlp\.gate_proj", {}, r"gate_proj.qzeros: quantization_config.sym is true but the zero points"),
        (r"+:.*\.0\..*down_proj", {"bits": 3}, r"quantization_config.dynamic\['.*down_proj'\].bits = 3 is not supp"),
        (r"-:.*\.0\..*down_proj", {}, r"quantization_config.dynamic\['-:.*down_proj'\] leaves model.layers.0.mlp."
                                      r"down_proj unquantized, but the checkpoint holds it packed"),
    ]:
        rules = {key: change, **{k: v for k, v in DYNAMIC.items() if k != key}}
        edited = rewrite(folder, tmp_path, dynamic=rules)
        if match is None:
            load_model(str(edited), device="cpu", load_tokenizer=False)
        else:
            refused(edited, PrequantizedError if "supp" in match else CheckpointError, match)
    refused(rewrite(folder, tmp_path, dynamic={"(": {}}), PrequantizedError,
            r"quantization_config.dynamic key '\(' is not a regular expression")


def test_a_packed_head_needs_lm_head_true_and_an_untied_embedding(tmp_path: Path) -> None:
    """GPTQModel quantizes the head only when `lm_head` is true, and refuses a head tied to the embedding;
    vLLM reads lm_head.* only then, and skips it on a tied model: pagedrl refuses both."""
    untied = tmp_path / "untied"
    write(untied, HEAD, {"lm_head": dict(bits=8)}, lm_head=True)
    refused(rewrite(untied, tmp_path, lm_head=None), CheckpointError,
            r"lm_head is packed but quantization_config.lm_head is not true")
    tied = tmp_path / "tied"
    write(tied, HEAD, {"lm_head": dict(bits=8)}, lm_head=True, base="qwen2-bias-tied")
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
    refused(tied, CheckpointError, r"tie_word_embeddings is true but lm_head is packed: a quantized head tied to the "
                                   r"embedding is not supported")
