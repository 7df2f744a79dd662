"""Which precision `dtype="auto"` and a trainer's `bf16: null` choose: bfloat16 where the device
computes it natively, float32 where it does not, and what forces either."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES

from pagedrl.engine.llm import LLM
from pagedrl.kernels import isa
from pagedrl.model import precision
from pagedrl.model.precision import FORCE_ENV, choose_precision, cpu_bf16_native, resolve_dtype
from pagedrl.train.offline_config import SFTConfig

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


@pytest.fixture()
def unforced(monkeypatch):
    """The probe decides (the suite otherwise forces float32); its cached answer is dropped."""
    monkeypatch.delenv(FORCE_ENV, raising=False)
    precision._probe.cache_clear()
    yield monkeypatch
    precision._probe.cache_clear()


def test_forced_either_way(monkeypatch) -> None:
    monkeypatch.setenv(FORCE_ENV, "1")
    assert choose_precision("cpu").dtype == torch.bfloat16 and FORCE_ENV in choose_precision("cpu").reason
    monkeypatch.setenv(FORCE_ENV, "0")
    assert choose_precision("cpu").dtype == torch.float32
    monkeypatch.setenv(FORCE_ENV, "yes")
    with pytest.raises(ValueError, match=FORCE_ENV):
        choose_precision("cpu")


def test_cuda_keeps_bf16(monkeypatch) -> None:
    monkeypatch.setenv(FORCE_ENV, "0")  # a CPU setting: CUDA is not asked
    assert choose_precision("cuda").dtype == torch.bfloat16
    assert choose_precision("cuda:1").dtype == torch.bfloat16


def test_a_class_without_bf16_instructions_means_float32_without_a_probe(unforced) -> None:
    """An AVX2 or AVX512 CPU (or one capped to it) computes in float32 whatever oneDNN offers."""
    for name in ("avx2", "avx512"):
        unforced.setattr(isa, "cpu_class", lambda name=name: name)
        unforced.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
        unforced.setattr(precision, "probe_bf16_speedup", lambda: 9.0)
        precision._probe.cache_clear()
        native, why = cpu_bf16_native()
        assert not native and f"CPU class {name}" in why and choose_precision("cpu").dtype == torch.float32


def test_the_probe_decides_when_onednn_says_yes(unforced) -> None:
    """oneDNN also says yes on an AVX512 CPU that only emulates bf16: the timed matmul settles it (a
    class with the instructions, so that the probe is what is asked)."""
    unforced.setattr(isa, "cpu_class", lambda: "avx512_bf16")
    unforced.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    unforced.setattr(precision, "probe_bf16_speedup", lambda: 0.4)
    native, why = cpu_bf16_native()
    assert not native and "0.4x" in why and choose_precision("cpu").dtype == torch.float32
    precision._probe.cache_clear()
    unforced.setattr(precision, "probe_bf16_speedup", lambda: 2.5)
    assert cpu_bf16_native()[0] and choose_precision("cpu").dtype == torch.bfloat16


def test_no_onednn_bf16_means_float32_without_a_probe(unforced) -> None:
    unforced.setattr(isa, "cpu_class", lambda: "avx512_bf16")
    unforced.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)

    def never() -> float:
        raise AssertionError("probed a CPU that oneDNN says has no bf16")

    unforced.setattr(precision, "probe_bf16_speedup", never)
    native, why = cpu_bf16_native()
    assert not native and "oneDNN" in why


def test_the_real_probe_answers_once_per_process(unforced) -> None:
    calls = []
    real = precision.probe_bf16_speedup
    unforced.setattr(precision, "probe_bf16_speedup", lambda: calls.append(1) or real())
    first = cpu_bf16_native()
    assert cpu_bf16_native() == first and len(calls) <= 1
    assert real(repeats=2) > 0


def test_requested_dtypes_win() -> None:
    assert resolve_dtype("float32", "cpu").dtype == torch.float32
    assert resolve_dtype(torch.bfloat16, "cpu").reason == "requested"
    with pytest.raises(ValueError, match="dtype: unknown 'float99'"):
        resolve_dtype("float99", "cpu")
    with pytest.raises(ValueError, match="dtype: unknown 'long'"):  # a torch dtype, not a weights' precision
        resolve_dtype("long", "cpu")
    assert (resolve_dtype("half", "cpu").dtype, resolve_dtype("float", "cpu").dtype) == (torch.float16, torch.float32)


@pytest.mark.parametrize("forced, expected", [("1", torch.bfloat16), ("0", torch.float32)])
def test_llm_and_trainer_follow_the_choice(tiny_train_model, monkeypatch, forced, expected) -> None:
    monkeypatch.setenv(FORCE_ENV, forced)
    llm = LLM(str(tiny_train_model), kv_cache_tokens=256)
    assert llm.precision.dtype == expected and llm.engine.model.dtype == expected
    assert llm.engine.kv_cache.dtype == expected and FORCE_ENV in llm.precision.reason
    assert LLM(str(tiny_train_model), kv_cache_tokens=256, dtype="float32").engine.model.dtype == torch.float32
    config = SFTConfig(model="m", dataset="d")
    assert config.use_bf16("cpu") == (expected == torch.bfloat16)
    assert not SFTConfig(model="m", dataset="d", bf16=False).use_bf16("cpu")
    assert "bf16=false" in SFTConfig(model="m", dataset="d", bf16=False).precision_reason("cpu")


def test_families_load_in_bf16_when_chosen(monkeypatch) -> None:
    """A bf16 load keeps the rotary frequencies in float32 (they are computed, not loaded)."""
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    monkeypatch.setenv(FORCE_ENV, "1")
    model = CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])).to(choose_precision("cpu").dtype)
    assert model.dtype == torch.bfloat16 and model.model.inv_freq.dtype == torch.float32
