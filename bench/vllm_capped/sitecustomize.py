"""vLLM's CPU backend as an AVX2-only CPU runs it, on a wider CPU: loaded by every Python process of
vLLM's environment that `bench/bench_vllm_cpu.py` starts under `PAGEDRL_CPU_ISA=avx2`
(`python -m pagedrl.kernels.isa run avx2 -- ...`), its engine-core process included.

vLLM picks its kernel library (`vllm._C_AVX2` or the AVX512 builds), its attention kernels and its
AMX paths from torch's probes of the hardware (`torch.cpu._is_avx512_supported()` and the like), which
no environment variable caps; torch's own vector code, torch.compile's generated C++, oneDNN and MKL
follow the capped variables the same command sets. Here the probes answer as on an AVX2-only CPU.
The memory, caches and clock stay the host's: what this gives is the AVX2 code paths on this machine,
not an AVX2-only CPU's figures.
"""

import os

if os.environ.get("PAGEDRL_CPU_ISA") == "avx2":
    import torch.cpu

    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, lambda: False)
