"""The CPU class this process runs as: AVX2, AVX512, AVX512-BF16 or AMX, asked once.

Every fast path depends on the class: the engine's C++ kernels are compiled for it, the bf16 dot
products and AMX tiles exist only from AVX512-BF16 up, oneDNN's packed bf16 weights need AVX512BW/VL/DQ,
and torch's own vector code (the order of its float32 reductions) follows its dispatch capability.

`PAGEDRL_CPU_ISA=avx2|avx512|avx512_bf16|amx` caps the class below the hardware's, so that a newer
CPU runs as an older one would: pagedrl's probes answer for the cap, its kernels are compiled without
the instructions above it (their build is keyed by the flags, so each class keeps its own), and
`python -m pagedrl.kernels.isa run CLASS -- COMMAND` starts COMMAND with torch (`ATEN_CPU_CAPABILITY`),
oneDNN (`ONEDNN_MAX_CPU_ISA`) and MKL (`MKL_ENABLE_INSTRUCTIONS`) capped alike, which is how
`make test-isa` runs the ISA-dependent tests as each lower class sees them. A cap cannot add what the
hardware lacks: above the hardware's class it is refused with one line.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path

ENV = "PAGEDRL_CPU_ISA"
CLASSES = ("avx2", "avx512", "avx512_bf16", "amx")  # in order: each has all the instructions of those before
DESCRIPTIONS = {
    "base": "x86-64 without AVX2",
    "avx2": "AVX2 + FMA, no AVX512",
    "avx512": "AVX512 (F/BW/VL/DQ) without bf16; capped, without VNNI too",
    "avx512_bf16": "AVX512-BF16, no AMX",
    "amx": "AMX (and AVX512-BF16)",
    "other": "not x86-64",
}
# What each class needs in /proc/cpuinfo's flags.
_NEEDS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16"},
}
# GCC flags that remove the instructions above a capped class from the kernels' build: a cap runs as the
# class's oldest CPU (AVX2 as AMD Zen 2/3, without AVX-VNNI; AVX512 as Skylake-SP, without VNNI and VBMI,
# which Cascade Lake and Ice Lake add), so that the code for the fewest instructions is the one the suite
# builds and checks. The same for oneDNN: its `AVX512_CORE` is Skylake-SP's set.
_ABOVE = {
    "avx2": ["-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "avx512": ["-mno-avx512vnni", "-mno-avxvnni", "-mno-avx512vbmi", "-mno-avx512vbmi2", "-mno-avx512ifma",
               "-mno-avx512vpopcntdq", "-mno-avx512bitalg", "-mno-gfni", "-mno-vaes", "-mno-vpclmulqdq",
               "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "avx512_bf16": ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "amx": [],
}
# The same cap for the libraries torch brings (their own variables and spellings).
_LIBRARY_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {},
}


def cpu_flags() -> frozenset[str]:
    """The feature flags Linux reports for the first CPU (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def hardware_class(flags: frozenset[str] | None = None) -> str:
    """The highest class whose instructions the CPU has, in `CLASSES`' order ("base" below AVX2,
    "other" off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64") and flags is None:
        return "other"
    flags = cpu_flags() if flags is None else flags
    found = "base"
    for name in CLASSES:
        if not _NEEDS[name] <= flags:
            break
        found = name
    return found


@functools.cache
def cpu_class() -> str:
    """The class this process runs as: the hardware's, or `PAGEDRL_CPU_ISA` where that is lower."""
    hardware = hardware_class()
    cap = os.environ.get(ENV, "").strip().lower()
    if not cap:
        return hardware
    if cap not in CLASSES:
        raise ValueError(f"{ENV}={cap!r}: expected one of {', '.join(CLASSES)}")
    if hardware not in CLASSES or CLASSES.index(cap) > CLASSES.index(hardware):
        raise ValueError(f"{ENV}={cap}: this CPU is {DESCRIPTIONS[hardware]}; a cap can only hide instructions")
    return cap


def capped() -> bool:
    """Whether `PAGEDRL_CPU_ISA` hides some of the hardware's instructions from this process."""
    return cpu_class() != hardware_class()


def at_least(name: str) -> bool:
    """Whether this process may use the instructions of class `name`."""
    here = cpu_class()
    return here in CLASSES and CLASSES.index(here) >= CLASSES.index(name)


def describe() -> str:
    """One line for start-up messages and test skips: the class, and the cap if there is one."""
    here = cpu_class()
    text = f"{here} ({DESCRIPTIONS[here]})"
    return text + f", capped by {ENV} (the hardware: {hardware_class()})" if capped() else text


def build_flags() -> list[str]:
    """The target flags for the kernels' build: the machine's own instructions, less those above the
    cap."""
    flags = ["-march=native"]
    return flags + _ABOVE[cpu_class()] if capped() else flags


def capped_environment(name: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (the process's by default) with every library capped at class `name`."""
    if name not in CLASSES:
        raise ValueError(f"unknown CPU class {name!r}: expected one of {', '.join(CLASSES)}")
    env = dict(os.environ if environ is None else environ)
    env.update(_LIBRARY_CAPS[name])
    env[ENV] = name
    return env


def classes_below_hardware() -> list[str]:
    """The lower classes this machine can run as, besides its own."""
    hardware = hardware_class()
    return list(CLASSES[:CLASSES.index(hardware)]) if hardware in CLASSES else []


USAGE = """usage: python -m pagedrl.kernels.isa            this CPU's class and the class this process runs as
       python -m pagedrl.kernels.isa below      the lower classes this CPU can run as, one a line
       python -m pagedrl.kernels.isa run CLASS -- COMMAND...   COMMAND as a CPU of CLASS would see it"""


def main(argv: list[str] | None = None) -> int:
    """The command line `make test-isa` drives; `run` on a class above this CPU's exits 0 with a line
    saying it could not be shown here."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(f"this CPU: {hardware_class()} ({DESCRIPTIONS[hardware_class()]}); runs as {describe()}")
        return 0
    if args == ["below"]:
        print("\n".join(classes_below_hardware()))
        return 0
    if args[0] != "run" or len(args) < 4 or args[2] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    name, command = args[1], args[3:]
    if name not in CLASSES:
        print(f"unknown CPU class {name!r}: expected one of {', '.join(CLASSES)}", file=sys.stderr)
        return 2
    if name != hardware_class() and name not in classes_below_hardware():
        print(f"{name}: not run, this CPU is {DESCRIPTIONS[hardware_class()]} and a class above it cannot be "
              "shown here", flush=True)
        return 0
    print(f"running as {name} ({DESCRIPTIONS[name]}) on a {hardware_class()} CPU: {' '.join(command)}", flush=True)
    os.execvpe(command[0], command, capped_environment(name))
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
