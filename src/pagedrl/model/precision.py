"""Which precision a device computes in when nobody says (`dtype="auto"`, a trainer's `bf16: null`).

A GPU computes in bfloat16. A CPU does too when it has the instructions for it (x86 with
AVX512-BF16 or AMX, Arm with BF16): there a bf16 matmul runs ~2.4x as fast as float32 and reads
half the bytes, as vLLM's CPU backend assumes. Elsewhere bf16 is emulated and several times slower
than float32, so float32 is chosen.

The answer comes from the CPU class (`kernels/isa.py`: an x86 CPU below AVX512-BF16 has no bf16
instructions, whatever oneDNN offers), what torch reports (oneDNN's bf16 support, the CPU capability
it dispatches to), and a micro-probe: a bf16 matmul timed against a float32 one, once per process. The
probe is what decides, because oneDNN also says yes on an AVX512 CPU that only emulates bf16; the
hardware's name is never read. `PAGEDRL_CPU_BF16=1` / `=0` forces the answer (a CPU without native
bf16 can be simulated that way, and a test suite can pin float32).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

from pagedrl.kernels import isa

FORCE_ENV = "PAGEDRL_CPU_BF16"
# What `--dtype` takes, as vLLM spells them (half = float16, float = float32).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "half", "float")
# What `--quantization` takes (`model/loader.py`): a GGUF's blocks kept as they are; int8 / int4 weight-only
# quantization made at load (`model/weight_only.py`); mxfp4: gpt-oss's published MXFP4 experts kept so
# (`model/mxfp4_loading.py`).
QUANTIZATIONS = ("gguf", "int8", "int4", "mxfp4", "gptq", "awq", "compressed-tensors")
ACTIVATIONS = ("float32", "int8")  # what a quantized model's engine products multiply the weights by
DTYPE_HELP = ("auto: bfloat16 on CUDA and on CPUs that compute it natively (AVX512-BF16, AMX, Arm BF16), "
              "float32 elsewhere")
# bf16 must beat float32 by this much in the probe to count as native (emulated bf16 is ~0.1-0.5x).
MIN_SPEEDUP = 1.3


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_precision(device: str | torch.device) -> Precision:
    """The default precision on `device`: bfloat16 on CUDA and on CPUs that compute it natively,
    float32 on other CPUs."""
    device = torch.device(device)
    if device.type == "cuda":
        return Precision(torch.bfloat16, "CUDA")
    if device.type != "cpu":
        return Precision(torch.float32, f"{device.type}: float32 unless a dtype is given")
    native, why = cpu_bf16_native()
    return Precision(torch.bfloat16 if native else torch.float32, why)


def cpu_bf16_native() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and why we think so."""
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"{FORCE_ENV}={forced}"
    if forced:
        raise ValueError(f"{FORCE_ENV} must be 0 or 1, got {forced!r}")
    return _probe()


@functools.cache
def _probe() -> tuple[bool, str]:
    capability = torch.backends.cpu.get_cpu_capability()
    if isa.cpu_class() in isa.CLASSES and not isa.at_least("avx512_bf16"):
        return False, f"CPU class {isa.describe()}: no bf16 instructions (capability {capability})"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False, f"CPU without bf16 support in oneDNN (capability {capability})"
    speedup = probe_bf16_speedup()
    if speedup < MIN_SPEEDUP:
        return False, f"CPU bf16 only {speedup:.1f}x float32 in a matmul probe (emulated; capability {capability})"
    return True, f"CPU with native bf16: {speedup:.1f}x float32 in a matmul probe (capability {capability})"


def probe_bf16_speedup(rows: int = 64, dim: int = 512, repeats: int = 15) -> float:
    """float32 time / bf16 time of one [rows, dim] @ [dim, 4·dim] matmul on one thread, best of
    `repeats` each, the two taking turns (about 30 ms in all). One thread, turns, and the best of many:
    threads wait for each other, so another process holding one core stalls a two-thread call by
    whatever it takes, and on a loaded host five two-thread float32 calls followed by five bf16 ones
    once measured 2.4x as 1.2x and chose float32."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, dim, generator=g)
    b = torch.randn(dim, 4 * dim, generator=g)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in pairs.values():
            torch.mm(x, y)  # first call: kernel selection and scratch allocation, not timed
        best = dict.fromkeys(pairs, float("inf"))
        for _ in range(repeats):
            for dtype, (x, y) in pairs.items():
                start = time.perf_counter()
                torch.mm(x, y)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device) -> Precision:
    """A requested dtype (`None` / "auto": the device's default) with the reason it was chosen."""
    if dtype is None or dtype == "auto":
        return choose_precision(device)
    if isinstance(dtype, str):
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: unknown {dtype!r}; expected one of {', '.join(DTYPE_CHOICES)}")
        dtype = getattr(torch, dtype)
    assert isinstance(dtype, torch.dtype)
    return Precision(dtype, "requested")
