"""The CPU class a process runs as (`kernels/isa.py`): read from the CPU's flags, capped by
`PAGEDRL_CPU_ISA` but never raised, and carried to torch, oneDNN, MKL and the kernels' build alike,
which is what lets one machine run the ISA-dependent tests as each lower class (`make test-isa`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedrl.kernels import isa

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture
def fresh_class(monkeypatch: pytest.MonkeyPatch):
    """`cpu_class()` asked anew under the test's environment, and forgotten after it."""
    isa.cpu_class.cache_clear()
    yield monkeypatch
    isa.cpu_class.cache_clear()


@pytest.mark.parametrize(("flags", "expected"), [
    (frozenset({"sse4_2", "avx"}), "base"), (AVX2 - {"fma"}, "base"), (AVX2, "avx2"),
    (AVX2 | {"avx512f"}, "avx2"),  # AVX512F alone (Xeon Phi) lacks BW/VL/DQ
    (AVX512, "avx512"), (AVX512_BF16, "avx512_bf16"), (AMX, "amx"),
    (AVX512 | {"amx_tile", "amx_bf16"}, "avx512"),  # classes are cumulative
])
def test_the_class_is_the_highest_whose_instructions_are_all_there(flags, expected) -> None:
    assert isa.hardware_class(flags) == expected


def test_a_cap_hides_instructions_and_never_adds_them(fresh_class: pytest.MonkeyPatch) -> None:
    hardware = isa.hardware_class()
    if hardware not in isa.CLASSES:
        pytest.skip(f"needs an x86-64 CPU with AVX2 at least; this one is {isa.DESCRIPTIONS[hardware]}")
    fresh_class.delenv(isa.ENV, raising=False)
    assert isa.cpu_class() == hardware and not isa.capped() and isa.build_flags() == ["-march=native"]
    fresh_class.setenv(isa.ENV, "avx2")
    isa.cpu_class.cache_clear()
    assert isa.cpu_class() == "avx2" and isa.at_least("avx2") and not isa.at_least("avx512")
    assert isa.capped() == (hardware != "avx2") and "avx2" in isa.describe()
    if hardware != "avx2":
        assert "-mno-avx512f" in isa.build_flags() and "-mno-amx-tile" in isa.build_flags()
    for wrong in ("sse", "AVX3"):
        fresh_class.setenv(isa.ENV, wrong)
        isa.cpu_class.cache_clear()
        with pytest.raises(ValueError, match=isa.ENV):
            isa.cpu_class()
    above = isa.CLASSES[isa.CLASSES.index(hardware) + 1:]
    for name in above:
        fresh_class.setenv(isa.ENV, name)
        isa.cpu_class.cache_clear()
        with pytest.raises(ValueError, match="can only hide"):
            isa.cpu_class()


# The compiler's macros the kernels key their paths on, which a build capped at the class must not define.
_NOT_BELOW = {
    "avx2": ("__AVX512F__", "__AVXVNNI__", "__AMX_TILE__"),
    "avx512": ("__AVX512VNNI__", "__AVX512VBMI__", "__AVX512BF16__", "__AMX_TILE__"),
    "avx512_bf16": ("__AMX_TILE__",),
}


@pytest.mark.parametrize("name", sorted(_NOT_BELOW))
def test_a_capped_build_defines_none_of_the_instructions_above_its_class(
        name: str, fresh_class: pytest.MonkeyPatch) -> None:
    """What the compiler defines under a cap's flags, asked of the compiler itself: a cap at `avx512`
    builds the 8-bit products' code without VNNI (Skylake-SP's), which no native build here would."""
    hardware = isa.hardware_class()
    if hardware not in isa.CLASSES or isa.CLASSES.index(name) >= isa.CLASSES.index(hardware):
        pytest.skip(f"needs a CPU above class {name}; this one is {isa.DESCRIPTIONS[hardware]}")
    fresh_class.setenv(isa.ENV, name)
    compiler = os.environ.get("CXX", "c++")  # the one torch's extension builder calls
    macros = subprocess.run([compiler, *isa.build_flags(), "-dM", "-E", "-x", "c++", "/dev/null"],
                            capture_output=True, text=True, check=True).stdout
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    assert "__AVX2__" in defined and "__FMA__" in defined
    assert not defined & set(_NOT_BELOW[name]), sorted(defined & set(_NOT_BELOW[name]))
    if name != "avx2":
        assert {"__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__"} <= defined


def test_the_capped_environment_caps_every_library() -> None:
    env = isa.capped_environment("avx2", {"PATH": "/bin"})
    assert env == {"PATH": "/bin", isa.ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert isa.capped_environment("avx512_bf16", {})["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert isa.capped_environment("amx", {}) == {isa.ENV: "amx"}
    with pytest.raises(ValueError, match="unknown CPU class"):
        isa.capped_environment("sse2")


def test_a_command_run_as_the_lowest_class_sees_torch_and_onednn_capped() -> None:
    """`run avx2 -- python ...`: torch dispatches to AVX2 code, oneDNN offers no bf16, pagedrl's probe
    says avx2 and its precision is float32 (bf16 there would be emulated)."""
    if isa.hardware_class() not in isa.CLASSES:
        pytest.skip(f"needs an x86-64 CPU with AVX2 at least; this one is {isa.DESCRIPTIONS[isa.hardware_class()]}")
    probe = ("import torch; from pagedrl.kernels import isa; from pagedrl.model.precision import cpu_bf16_native; "
             "print(torch.backends.cpu.get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported(), "
             "isa.cpu_class(), cpu_bf16_native()[0])")
    env = {k: v for k, v in isa.capped_environment("avx2").items() if k != "PAGEDRL_CPU_BF16"}
    done = subprocess.run([sys.executable, "-m", "pagedrl.kernels.isa", "run", "avx2", "--", sys.executable, "-c", probe],
                          capture_output=True, text=True, env=env, timeout=120, check=True)
    assert done.stdout.splitlines()[-1] == "AVX2 False avx2 False"


def test_the_command_line_lists_and_refuses_classes(capsys: pytest.CaptureFixture[str]) -> None:
    assert isa.main(["below"]) == 0
    below = capsys.readouterr().out.split()
    hardware = isa.hardware_class()
    assert below == (list(isa.CLASSES[:isa.CLASSES.index(hardware)]) if hardware in isa.CLASSES else [])
    assert isa.main(["run", "sse2", "--", "true"]) == 2
    assert isa.main(["run", "avx2"]) == 2
    if hardware != "amx":  # a class above the hardware: said, not run, not a failure
        assert isa.main(["run", "amx", "--", "false"]) == 0
        assert "cannot be shown here" in capsys.readouterr().out
