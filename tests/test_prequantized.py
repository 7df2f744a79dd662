"""Pre-quantized GPTQ, AWQ and compressed-tensors folders (`model/prequantized.py`), written by the
methods' own packers (tests/prequantized_writers.py): the weights pagedrl holds are the methods' own
dequantizations bit for bit (compressed-tensors' through transformers, rounded to the half it computes in;
AWQ's by GPTQModel's `dequantize_gemm`; GPTQ's the float64 arithmetic of the codes GPTQModel packed), the
engine's tokens and log-probs are those of the float32 model of those weights, and what cannot be held is
refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from prequantized_writers import FAMILY, packing_utils, projections, write_compressed_tensors, write_packed
from safetensors import safe_open
from safetensors.torch import save_file
from test_multi_lora_quantized import LORA, assert_each_request_as_on_the_twin, two_adapters
from test_weight_only import assert_engine_equals_twin, dequantized_twin
from tiny import FAMILIES, hf_model
from tiny_train import build_tokenizer

from pagedrl import LLM
from pagedrl.cli import main
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.checkpoint import TOKENIZER_FILES, CheckpointError, load_causal_lm, save_checkpoint
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.loader import load_model
from pagedrl.model.prequantized import Q8_0_OF_4BIT, hold
from pagedrl.model.prequantized_codes import Codes
from pagedrl.model.prequantized_config import PrequantizedError
from pagedrl.model.tokenizer import Tokenizer


def held(model: torch.nn.Module, name: str) -> torch.Tensor:
    module = model.get_submodule(name)
    return module.dequantized() if isinstance(module, GGUFLinear) else module.weight.detach()


def test_q4_1_takes_asymmetric_codes_where_a_shift_is_exact() -> None:
    """Codes less per-group zero points in 0..15, scales of few significant bits: every block finds a
    shift c with c * s a half and is held in Q4_1, which gguf's own decoder reads back as s * v exactly;
    one scale of 11 significant bits and an odd zero point leave only Q8_0."""
    g = torch.Generator().manual_seed(5)
    zeros = torch.randint(0, 16, (6, 4, 1), generator=g)
    values = (torch.randint(0, 16, (6, 4, 32), generator=g) - zeros).reshape(6, 128).int()
    scales = (torch.randint(1, 8, (6, 4), generator=g) * 2.0 ** -torch.randint(6, 12, (6, 4), generator=g)).double()
    module, layout = hold(Codes(values, scales, None, 4), None)
    assert layout == "Q4_1"
    exact = (scales.repeat_interleave(32, dim=1) * values.double()).float().numpy()
    assert np.array_equal(gguf_dequantize(module.qweight.numpy(), Q.Q4_1).reshape(6, 128), exact)
    minimums = module.qweight.numpy().reshape(6, 4, 20)[:, :, 2:4].copy().view(np.float16)[..., 0]  # -c * s
    assert len(set((-minimums / scales.numpy()).ravel().tolist())) > 2  # shifts c other than 0 and 8
    scales[0, 0], values[0, :32] = 1 + 2.0 ** -10, torch.arange(32).int() % 16 - 7  # z = 7: 7 * s needs 14 bits
    assert hold(Codes(values, scales, None, 4), None)[1] == Q8_0_OF_4BIT


CT_CASES = [  # (format, bits, symmetric, strategy, group, the layout every projection gets)
    ("pack-quantized", 4, True, "group", 32, "Q4_1"),
    ("pack-quantized", 4, False, "group", 32, Q8_0_OF_4BIT),
    ("pack-quantized", 8, True, "channel", None, "Q8_0"),
    ("naive-quantized", 8, True, "group", 32, "Q8_0"),
    ("pack-quantized", 4, True, "group", 16, "float32 (dequantized at load: groups of 16)"),
]


@pytest.mark.parametrize("fmt,bits,symmetric,strategy,group,layout", CT_CASES)
def test_compressed_tensors_weights_and_logits_are_transformers(tmp_path: Path, fmt: str, bits: int, symmetric: bool,
                                                                strategy: str, group: int | None, layout: str) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = write_compressed_tensors(tmp_path / "ct", fmt, bits, symmetric, strategy, group)
    loaded = load_model(str(folder), device="cpu", load_tokenizer=False)
    assert f"compressed-tensors {bits}-bit weight-only, read from the checkpoint: {layout} x 14" \
        in loaded.precision.describe()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16,
                                              quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, module in projections(hf).items():  # its fp16 product: ours (exact) rounded once to a half
        assert torch.equal(held(loaded.model, name).half().view(torch.int16), module.weight.view(torch.int16)), name
    ids = torch.tensor([[3, 40, 7, 99, 12, 5]])
    with torch.no_grad():
        ours = loaded.model.logits(loaded.model(ids))
        theirs = hf.float()(ids).logits
    assert torch.allclose(ours, theirs, rtol=0, atol=2e-3)  # weights apart by a half's rounding (< 5e-4 relative)


PACKED_CASES = [  # (method, bits, symmetric, desc_act, layout)
    ("awq", 4, False, False, Q8_0_OF_4BIT),
    ("gptq", 4, False, False, Q8_0_OF_4BIT),
    ("gptq", 4, True, False, "Q4_1"),
    ("gptq", 8, True, False, "Q8_0"),
    ("gptq", 8, False, False, "float32 (dequantized at load: codes beyond an int8)"),
    ("gptq", 4, True, True, "float32 (dequantized at load: act-order groups)"),
]


@pytest.mark.parametrize("method,bits,symmetric,desc_act,layout", PACKED_CASES)
def test_gptq_and_awq_weights_are_the_packed_codes(tmp_path: Path, method: str, bits: int, symmetric: bool,
                                                   desc_act: bool, layout: str) -> None:
    folder = tmp_path / method
    expected = write_packed(folder, method, bits, symmetric=symmetric, desc_act=desc_act)
    loaded = load_model(str(folder), device="cpu", load_tokenizer=False)
    assert f"{method} {bits}-bit weight-only, read from the checkpoint: {layout} x 14" in loaded.precision.describe()
    for name, weight in expected.items():
        assert torch.equal(held(loaded.model, name).double(), weight), name
    if method == "awq":  # and GPTQModel's own AWQ dequantizer of the file's tensors, in float32 (exact there)
        dequantize_gemm = packing_utils().dequantize_gemm
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            for name in expected:
                qweight, qzeros, scales = (f.get_tensor(f"{name}.{leaf}") for leaf in ("qweight", "qzeros", "scales"))
                theirs = dequantize_gemm(qweight, qzeros, scales.float(), 4, 32).T
                assert torch.equal(held(loaded.model, name), theirs), name


def test_gptq_v2_repacked_from_awq_is_gptqmodels_awq_dequantization(tmp_path: Path) -> None:
    """GPTQModel's own AWQ -> GPTQ repacking (`unpack_reorder_pack`: GPTQ's packing, the zero points as
    they are, i.e. checkpoint_format gptq_v2) read by the GPTQ reader: GPTQModel's AWQ dequantization."""
    packing = packing_utils()
    write_packed(tmp_path / "awq", "awq")
    gptq = tmp_path / "gptq"
    shutil.copytree(tmp_path / "awq", gptq)
    with safe_open(str(gptq / "model.safetensors"), "pt") as f:
        state = {key: f.get_tensor(key) for key in f.keys()}
    oracle = {}
    for name in [key.removesuffix(".qweight") for key in state if key.endswith(".qweight")]:
        qweight, qzeros, scales = (state[f"{name}.{leaf}"] for leaf in ("qweight", "qzeros", "scales"))
        oracle[name] = packing.dequantize_gemm(qweight, qzeros, scales.float(), 4, 32).T
        state[f"{name}.qweight"], state[f"{name}.qzeros"] = packing.unpack_reorder_pack(qweight, qzeros, 4)
    save_file(state, str(gptq / "model.safetensors"), metadata={"format": "pt"})
    rewrite(gptq, tmp_path, into=gptq, quant_method="gptq", checkpoint_format="gptq_v2", desc_act=False, sym=False,
            version=None, zero_point=None)
    loaded = load_model(str(gptq), device="cpu", load_tokenizer=False)
    assert f"gptq 4-bit weight-only, read from the checkpoint: {Q8_0_OF_4BIT} x 14" in loaded.precision.describe()
    for name, weight in oracle.items():
        assert torch.equal(held(loaded.model, name), weight), name


@pytest.mark.parametrize("write", ["compressed-tensors", "gptq-act-order", "awq", "gptq-qwen2"])
def test_engine_computes_the_dequantized_float32_model(tmp_path: Path, write: str) -> None:
    """Through LLM(folder) with no quantization named: the config names it, as vLLM reads it. Qwen2: the
    projections' biases beside the packed weights, and the head tied to the embedding."""
    folder = tmp_path / write
    if write == "compressed-tensors":
        write_compressed_tensors(folder, "pack-quantized", 4, True, "group", 32)
    else:
        base = "qwen2-bias-tied" if write == "gptq-qwen2" else FAMILY
        write_packed(folder, write[:4], 4, symmetric=True, desc_act=write == "gptq-act-order", base=base)
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.decode_path().startswith("decode steps as one program")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the biases beside the blocks: the file's
        biases = {key: f.get_tensor(key) for key in f.keys() if key.endswith("proj.bias")}
    assert len(biases) == (6 if write == "gptq-qwen2" else 0)
    for key, bias in biases.items():
        assert torch.equal(llm.engine.model.get_submodule(key.removesuffix(".bias")).bias, bias.float())
    twin = dequantized_twin(llm.engine.model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 200, size=n).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
    assert_engine_equals_twin(llm, twin, prompts, params)


def test_resident_bytes_are_the_blocks(tmp_path: Path) -> None:
    """Symmetric 4-bit groups of 32 held as Q4_1: 20 bytes per 32 weights; the rest float32."""
    folder = write_compressed_tensors(tmp_path / "ct", "pack-quantized", 4, True, "group", 32)
    llm = LLM(str(folder), quantization="compressed-tensors")
    model = llm.engine.model
    blocks = sum(m.out_features * m.in_features // 32 * 20 for m in model.modules() if isinstance(m, GGUFLinear))
    others = [*model.parameters(), *(b for name, b in model.named_buffers() if not name.endswith(".qweight"))]
    assert blocks and llm.engine.weight_bytes == blocks + sum(t.numel() * t.element_size() for t in others)
    assert all(t.dtype == torch.float32 for t in others)  # the embedding, the head and the norms
    llm.close()


def gptq_with_tokenizer(tmp_path: Path) -> Path:
    build_tokenizer(tmp_path / "tokenizer")
    folder = tmp_path / "gptq"
    write_packed(folder, "gptq", 4, symmetric=True, vocab_size=Tokenizer.from_folder(tmp_path / "tokenizer").vocab_size)
    for name in TOKENIZER_FILES:
        if (tmp_path / "tokenizer" / name).is_file():
            shutil.copy(tmp_path / "tokenizer" / name, folder / name)
    return folder


def completion(folder: Path, *flags: str) -> str:
    from fastapi.testclient import TestClient

    from pagedrl.server.serve import build_parser, build_server

    server = build_server(build_parser().parse_args([str(folder), "--no-ui", *flags]))
    with TestClient(server.config.app) as client:
        body = client.post("/v1/completions", json={"model": str(folder), "prompt": "what is 1 plus 2",
                                                    "max_tokens": 6, "temperature": 0}).json()
    return body["choices"][0]["text"]


def test_generate_and_serve_read_the_method_from_the_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = gptq_with_tokenizer(tmp_path)
    llm = LLM(str(folder))
    (expected,) = llm.generate("what is 1 plus 2", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    llm.close()
    assert main(["generate", str(folder), "--prompt", "what is 1 plus 2", "--max-tokens", "6", "--raw"]) == 0
    out = capsys.readouterr()
    assert "gptq 4-bit weight-only, read from the checkpoint: Q4_1 x 14" in out.err
    assert expected.outputs[0].text and expected.outputs[0].text in out.out
    assert completion(folder) == expected.outputs[0].text


def test_int8_activations_on_a_folder_whose_config_names_the_method(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """activations='int8' needs no `quantization` where the folder's config names it, as everywhere else: the
    same model, and the same tokens, as with quantization='gptq' (API, `generate` and `serve` flags)."""
    folder = gptq_with_tokenizer(tmp_path)
    named, read = (load_model(str(folder), device="cpu", quantization=q, activations="int8") for q in ("gptq", None))
    assert "8-bit activations (llama.cpp's arithmetic) for Q4_1 x 14" in read.precision.describe()
    assert read.precision.describe() == named.precision.describe()
    llm = LLM(str(folder), quantization="gptq", activations="int8")
    (expected,) = llm.generate("what is 1 plus 2", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    llm.close()
    assert main(["generate", str(folder), "--prompt", "what is 1 plus 2", "--max-tokens", "6", "--raw",
                 "--activations", "int8"]) == 0
    out = capsys.readouterr()
    assert "8-bit activations (llama.cpp's arithmetic) for Q4_1 x 14" in out.err
    assert expected.outputs[0].text and expected.outputs[0].text in out.out
    assert completion(folder, "--activations", "int8") == expected.outputs[0].text


def rewrite(folder: Path, tmp_path: Path, into: Path | None = None, **changes: object) -> Path:
    """A copy of `folder` (or `folder` itself, `into` it) whose quantization_config has `changes` (a value
    None: the field removed)."""
    copy = into or tmp_path / f"edit{len(list(tmp_path.iterdir()))}"
    if into is None:
        shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    quant = config["quantization_config"]
    for key, value in changes.items():
        quant.pop(key) if value is None else quant.__setitem__(key, value)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_refusals_are_one_clear_line(tmp_path: Path) -> None:
    gptq = tmp_path / "gptq"
    write_packed(gptq, "gptq", 4, symmetric=True)
    ct = write_compressed_tensors(tmp_path / "ct", "pack-quantized", 4, True, "group", 32)
    with pytest.raises(ValueError, match=r"quantization='int4' does not agree with .*config.json's "
                                         r"quantization_config.quant_method 'gptq'"):
        load_model(str(gptq), quantization="int4")
    with pytest.raises(ValueError, match=r"quantization='awq' does not agree .*quant_method 'gptq'"):
        load_model(str(gptq), quantization="awq")
    group = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    supported = r"is not supported; supported: gptq \(4 or 8 bits"
    for folder, changes, field in [
        (gptq, dict(bits=3), "bits = 3"),
        (gptq, dict(checkpoint_format="marlin"), 'checkpoint_format = "marlin"'),
        (gptq, dict(quant_method="awq", version="gemv"), 'version = "gemv"'),
        (gptq, dict(quant_method="fp8"), 'quant_method = "fp8"'),
        (ct, dict(format="float-quantized", config_groups={"g": dict(group, format=None)}), 'format = "float-quantized"'),
        (ct, dict(config_groups={"g": dict(group, input_activations={"num_bits": 8})}),
         r'config_groups.g.input_activations = \{"num_bits": 8\}'),
        (ct, dict(config_groups={"g": dict(group, weights=dict(group["weights"], num_bits=2))}),
         "config_groups.g.weights.num_bits = 2"),
        (ct, dict(config_groups={"g": dict(group, weights=dict(group["weights"], actorder="group"))}),
         'config_groups.g.weights.actorder = "group"'),
    ]:
        with pytest.raises((PrequantizedError, CheckpointError), match=rf"quantization_config.{field} {supported}"):
            load_model(str(rewrite(folder, tmp_path, **changes)), device="cpu", load_tokenizer=False)
    with pytest.raises(CheckpointError, match=r"quant_method 'gptq': pre-quantized weights, served kept quantized"):
        load_causal_lm(gptq)  # a float load (a trainer's) is refused, never read as garbage
    float_folder = tmp_path / "float"
    shutil.copytree(gptq, float_folder)
    config = json.loads((float_folder / "config.json").read_text())
    config.pop("quantization_config")
    (float_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization='gptq' reads a pre-quantized folder; .* has no quantization_config"):
        load_model(str(float_folder), quantization="gptq")


def test_adapters_per_request_on_a_gptq_base(tmp_path: Path) -> None:
    """enable_lora on a base kept in its checkpoint's blocks: each request's tokens and log-probs are those
    of the same adapters on the float32 model of the held weights (saved: a float folder, no
    quantization_config)."""
    folder = tmp_path / "gptq"
    write_packed(folder, "gptq", 4, symmetric=True)
    float_base = tmp_path / "float"
    hf_model(FAMILIES[FAMILY]).save_pretrained(float_base)  # the same shapes: the adapters' base
    quantized = LLM(str(folder), **LORA)
    twin = save_checkpoint(dequantized_twin(load_model(str(folder), load_tokenizer=False).model), tmp_path / "twin")
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    assert_each_request_as_on_the_twin(quantized, LLM(str(twin), **LORA), two_adapters(float_base, tmp_path),
                                       quantized.engine.model.config.vocab_size)
