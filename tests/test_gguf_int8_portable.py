"""The 8-bit products as a CPU without AVX2 builds them: `csrc/gguf_int8_dot.cpp` compiled for plain x86-64
(the kernels' portable code, what other architectures compile too), loaded in a process of its own, against
this machine's build on the same operands: within float32 rounding of the hand sums everywhere, and the
same bits where the kernels say so (the K-quants, and the Q4_K / Q5_K `rows8` layout whose group steps the
portable build replaces by unpacking for the lane groups)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.utils import cpp_extension

from pagedrl.kernels import ops
from pagedrl.model.gguf_rows8 import ROWS8, ROWS8_TYPES, pack_rows8
from tests.test_gguf_int8 import by_hand as blocks32_by_hand
from tests.test_gguf_int8_kquants import activation_rows
from tests.test_gguf_int8_kquants import by_hand as k_by_hand
from tests.test_gguf_linear import random_blocks

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("g++") is None,
                                reason="the portable build is compiled here for x86-64 with g++")

TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
SOURCE = Path(ops.__file__).parent / "csrc" / "gguf_int8_dot.cpp"
RUN = ("import sys, torch; torch.ops.load_library(sys.argv[1]); cases = torch.load(sys.argv[2]); "
       "torch.save([torch.ops.pagedrl_cpu.gguf_linear_int8(*c) for c in cases], sys.argv[3])")


def portable_library(folder: Path) -> Path:
    """`gguf_int8_dot.cpp` as a library for plain x86-64 (no AVX, no FMA, no F16C); -O2 inlines as -O3 does
    where it matters here (a register constraint only AVX can meet failed there, not at -O1), in half the time."""
    library = folder / "gguf_int8_portable.so"
    lib = cpp_extension.library_paths()[0]
    command = ["g++", "-std=c++17", "-O2", "-march=x86-64", "-fopenmp", "-fno-trapping-math", "-fPIC", "-shared", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{SOURCE.parent}", str(SOURCE),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(library)]
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]  # the compiler's own words
    return library


def test_the_portable_build_gives_the_hand_sums_and_the_k_quants_bits(tmp_path) -> None:
    assert ops.available()
    rng = np.random.default_rng(5)
    k = 512
    cases, hands = [], []
    for qtype in TYPES:
        values = 256 if qtype in K_TYPES else 32
        raw = torch.from_numpy(random_blocks(qtype, 24, k // values, rng, edges=False).reshape(24, -1))
        bias = torch.from_numpy(rng.standard_normal(24).astype(np.float32))
        for rows in (1, 3, 40):  # one row, a few (tiles / row by row), lane groups
            x = torch.from_numpy(activation_rows(rng, rows, k))
            hand = (k_by_hand if qtype in K_TYPES else blocks32_by_hand)(x.numpy(), raw.numpy(), qtype, bias.numpy())
            cases.append((x, raw, int(qtype), k, bias))
            hands.append((qtype, False, hand))
            if qtype in ROWS8_TYPES:
                cases.append((x, pack_rows8(raw, int(qtype)), int(qtype) + ROWS8, k, bias))
                hands.append((qtype, True, hand))
    torch.save(cases, tmp_path / "cases.pt")
    library = portable_library(tmp_path)
    ran = subprocess.run([sys.executable, "-c", RUN, str(library), str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    portable = torch.load(tmp_path / "out.pt")
    for case, got, (qtype, rows8, (want, scale)) in zip(cases, portable, hands, strict=True):
        native = ops.gguf_linear_int8(*case)
        bound = 4 * np.finfo(np.float32).eps * (k // 32 + 2) * scale + np.finfo(np.float32).tiny
        assert (np.abs(got.numpy() - want) <= bound).all(), (qtype.name, rows8, case[0].shape[0])
        if qtype in K_TYPES:  # the same integers, summed in the same float32 order on every build
            assert torch.equal(got, native), (qtype.name, rows8, case[0].shape[0])
