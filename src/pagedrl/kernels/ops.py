"""The engine's C++ kernels for the CPU, compiled once on the user's machine and cached.

`paged_attention` (`csrc/paged_attention.cpp`): attention of query rows read from keys and values
where they lie, through tables, one row at a time. Two uses:
- a decode step (`paged_decode`) reads the KV cache's blocks in place, instead of each sequence's
  blocks copied into a contiguous buffer every layer and then read again by SDPA (what the gather
  path does: three passes over the keys and values instead of one, and at 64 sequences of 300-400
  tokens the keys and values outweigh the model's weights);
- batch-invariant attention (`model/batch_invariant.py`): a row's result does not depend on what
  else is in the batch, so a token decoded by the engine and the same token in a trainer's packed
  forward get the same bits; with its backward for the trainer.

`paged_prefill` (`csrc/prefill_tiles.cpp`): a step's prompt chunks in bf16 or float32, a sequence's
consecutive rows in tiles over each chunk of keys (the row routine both share: `csrc/attention_rows.h`).

`decode_linear` (`csrc/decode_linear.cpp`): a bf16 linear layer's product for the rows of a decode
step, with AMX tiles or AVX512-BF16 dot products; `rms_norm`, `silu_mul` and `rope` (`csrc/rowwise.cpp`):
the decoder's row-wise pieces in one pass each. The engine routes its bf16 steps to them
(`engine/cpu_routes.py`). `gguf_linear` (`csrc/gguf_linear.cpp`): a GGUF weight's product with the
weight kept quantized (the bits of `float_linear` on the dequantized weight). `decode_layers`
(`csrc/decode_layers.cpp`): the decode program's layers (`engine/cpu_decode.py`) in one call.

They are compiled with `-O3 -march=native` (less the instructions above a `PAGEDRL_CPU_ISA` cap:
`kernels/isa.py`) through torch's extension builder (ninja and the system's C++
compiler) into pagedrl's cache directory, so only the first start pays
(about 10 s); where it cannot be built, the engine keeps the gather path and says so once.
`PAGEDRL_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from pagedrl.kernels import isa
from pagedrl.kernels.build_lock import BUILDER_FILE, pinned_ninja, wait_for_builder
from pagedrl.paths import cache_dir

logger = logging.getLogger(__name__)

# The one name of the C++ ops' namespace in the project: every call into them goes through a function
# of this module. Its attributes resolve once the library is loaded (`available()`).
_OPS = torch.ops.pagedrl_cpu

SOURCES = [Path(__file__).parent / "csrc" / name for name in (
    "paged_attention.cpp", "prefill_tiles.cpp", "decode_linear.cpp", "pair_linear.cpp", "rowwise.cpp", "float_linear.cpp",
    "float_gemm.cpp", "gguf_linear.cpp", "gguf_int8_dot.cpp", "threads.cpp", "decode_layers.cpp", "block_pool.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_math.h", "attention_rows.h", "attention_f32.h",
                                                     "prefill_tiles_f32.h", "float_lanes.h", "gguf_blocks.h", "gguf_int8_groups.h", "gguf_int8_row.h",
                                                     "gguf_int8_rows8.h", "gguf_int8_types.h",
                                                     "gguf_int8_kquants.h", "gguf_int8_kgroups.h", "gguf_int8_krows8.h")]  # the build's key too
DISABLE_ENV = "PAGEDRL_CPU_KERNELS"
PREFILL_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the head sizes `paged_prefill` is compiled for


def cflags() -> list[str]:
    """The machine's own vector instructions (less those above the process's CPU class), `omp simd`
    loops vectorized, and OpenMP for `at::parallel_for` (header code: without -fopenmp it runs on one
    thread). libgomp.so.1 resolves to the one torch already loaded, so there is one thread pool. No
    -ffast-math: float32 arithmetic in the kernel's order. -fno-trapping-math changes no value (it
    lets GCC assume no code reads the floating-point exception flags): without it, a select on a float
    comparison counts as control flow for AVX2, and the exponential's loops (softmax, SiLU) ran scalar,
    20x slower."""
    return ["-O3", *isa.build_flags(), "-mprefer-vector-width=512", "-fopenmp", "-fno-trapping-math"]


def build_dir() -> Path:
    """Keyed by the source, torch's version and the compiler flags: a change builds anew. And by where
    the sources lie: torch's build file names them by path, so two checkouts of one source sharing a
    cache would each find the other's build stale and rebuild it (a minute each time) in turn."""
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS) + str(SOURCES[0].resolve().parent).encode()
    key = hashlib.sha256(text + torch.__version__.encode() + " ".join(cflags()).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"paged_attention-{key}"


def available() -> bool:
    """Whether `torch.ops.pagedrl_cpu.paged_attention` can run: built (or loaded from the cache) on the
    first call, once per process."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in {"0", "false", "no", "off"}:
        return False
    return _load()


@functools.cache  # once per process (torch's builder holds a file lock for a concurrent first build)
def _load() -> bool:
    try:
        from torch.utils.cpp_extension import load

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        cached = (folder / "pagedrl_paged_attention.so").is_file()
        start = time.perf_counter()
        if not cached:  # a minute or more, or longer behind another process's build: say so first
            logger.info("building the CPU kernels for this CPU and source (once; later starts load them from %s)",
                        folder)
        wait_for_builder(folder)
        (folder / BUILDER_FILE).write_text(str(os.getpid()))
        with pinned_ninja():
            load(name="pagedrl_paged_attention", sources=[str(p) for p in SOURCES], build_directory=str(folder),
                 extra_cflags=cflags(), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        if not cached:
            logger.info("built the CPU paged-attention kernel in %.1f s (kept in %s for later starts)",
                        time.perf_counter() - start, folder)
        return True
    except Exception as e:  # no compiler, no ninja, a build error: the gather path still works
        logger.warning("the CPU paged-attention kernel could not be built (%s); decode steps gather each "
                       "sequence's blocks instead", str(e).strip().splitlines()[-1] if str(e).strip() else e)
        return False


@functools.cache
def decode_linear_available() -> bool:
    """Whether the kernels are built and this build has the bf16 dot-product instructions."""
    return available() and bool(_OPS.decode_linear_available())


@functools.cache
def decode_linear_amx() -> bool:
    """Whether `decode_linear` runs on AMX tiles here (any number of rows at near oneDNN's speed)."""
    return decode_linear_available() and bool(_OPS.decode_linear_amx())


def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """A step's new keys and values [N, Hkv, D] into their cache slots, in one call (no thread pool
    below 256 tokens)."""
    _OPS.store_kv(k, v, key_cache, value_cache, slot_mapping)


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [S, Hq, D] (one query per sequence, at its last position) over each sequence's seq_lens[s]
    cached keys and values (its last `window` when given) → [S, Hq, D]."""
    return paged_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window=window)[0]


@functools.cache
def paged_prefill_float32() -> bool:
    """Whether the kernels are built with float32 prefill tiles (AVX2 with FMA, or AVX512F)."""
    return available() and bool(_OPS.paged_prefill_float32())


def paged_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] bf16 or float32 (the caches alike), sequence s owning rows query_start_loc[s]:query_start_loc[s + 1], its last at
    position seq_lens[s] - 1 → [N, Hq, D], each row attended causally over its sequence's keys, in
    tiles of a prompt's consecutive rows (`csrc/prefill_tiles.cpp`); `window`, `softcap` and `sinks` as
    `paged_attention` takes them. Needs `decode_linear_available()` (the bf16 dot-product instructions)
    for bf16, `paged_prefill_float32()` for float32."""
    return _ops().paged_prefill(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                window or 0, softcap or 0.0, sinks)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                    row_lens: torch.Tensor, scale: float, row_seqs: torch.Tensor | None = None,
                    with_lse: bool = False, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D]: row r attends over the first row_lens[r] keys of sequence row_seqs[r] (row r's
    own when None), slot p of a sequence being tables[seq, p // B] * B + p % B for caches shaped
    [slots / B, B, Hkv, D]. Returns [N, Hq, D] and, with `with_lse`, each row's log-sum-exp of its
    scaled scores [N, Hq] in float32 (else an empty tensor). `window`: each row sees only its last
    `window` keys, and reads no others (the blocks below may be freed); `softcap`: scores become
    cap · tanh(s / cap); `sinks` [Hq]: a logit per head that joins each row's softmax denominator. The
    backward knows none of these three."""
    seqs = _rows(row_seqs)
    return _OPS.paged_attention(q, key_cache, value_cache, tables, seqs, row_lens, scale, with_lse,
                                window or 0, softcap or 0.0, sinks)


def paged_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, tables: torch.Tensor, row_lens: torch.Tensor,
                             scale: float, row_seqs: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dkeys, dvalues) of `paged_attention` given dO, its output and log-sum-exp."""
    seqs = _rows(row_seqs)
    return _OPS.paged_attention_backward(grad_out, q, keys, values, out, lse, tables, seqs, row_lens, scale)


def _ops():  # noqa: ANN202 (torch's op namespace)
    """The kernels' ops, loaded."""
    if not _load():
        raise RuntimeError("the CPU paged-attention kernel is not built here (see the warning above)")
    return _OPS


def _rows(row_seqs: torch.Tensor | None) -> torch.Tensor:
    """The kernel loaded, and `row_seqs` as the op takes it (empty: row r is sequence r)."""
    _ops()
    return _NO_ROWS if row_seqs is None else row_seqs


_NO_ROWS = torch.empty(0, dtype=torch.long)


# ------------------------------------------------------------------ products and row-wise pieces
# Thin typed faces of the ops, one per op, so that a caller's types and a kernel's terms are read in one
# place. They check nothing: their callers (`products.py`, `engine/cpu_routes.py`, the decode program)
# decide per call whether the kernel takes the tensors, and a decode step makes some 300 of these
# calls, where one more Python check each would show. Each needs the kernels loaded (`available()`).


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ weight [N, K].T (+ bias) → [M, N] bf16 with AMX tiles or AVX512-BF16 dot products,
    the weights read as they lie (`csrc/decode_linear.cpp`; `decode_linear_available()`)."""
    return _OPS.decode_linear(x, weight, bias)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 (rows of unit stride) @ weight [N, K].T (+ bias) → [M, N] float32, each output one
    chain in k order, so a row's outputs are alike in any batch (`csrc/float_linear.cpp`)."""
    return _OPS.float_linear(x, weight, bias)


def gguf_dequantize(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """A GGUF weight's rows of blocks [N, row_bytes] uint8 of GGML type `ggml_type` (Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4) → float32 [N, k], each value the bits `gguf.quants.dequantize` gives
    (`csrc/gguf_linear.cpp`)."""
    return _OPS.gguf_dequantize(blocks, ggml_type, k)


def gguf_dequantize_into(blocks: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor) -> None:
    """`gguf_dequantize` written into `out` (contiguous float32 [N, k]) instead of a fresh tensor."""
    _OPS.gguf_dequantize_into(blocks, ggml_type, k, out)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, k] float32 (rows of unit stride) @ the GGUF weight `blocks` [N, row_bytes].T (+ bias) → [M, N]
    float32 with the weights kept quantized: each output the bits `float_linear` gives on the dequantized
    weight."""
    return _OPS.gguf_linear(x, blocks, ggml_type, k, bias)


def gguf_linear_op() -> Callable[..., torch.Tensor]:
    """`gguf_linear`'s op itself, for a caller that has checked its arguments and calls it some 200 times
    a step (the decode program): torch's overload, without the packet's dispatch."""
    op = _OPS.gguf_linear
    return getattr(op, "default", op)


def gguf_linear_int8(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, k] float32 (rows of unit stride) @ the Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K weight
    `blocks` [N, row_bytes].T (+ bias) → [M, N] float32 as llama.cpp computes it: each row quantized to 8
    bits per 32 values (per 256 for the K-quants), integer dot products of the blocks, scaled in float32
    (`csrc/gguf_int8_dot.cpp`, `csrc/gguf_int8_kquants.h`)."""
    return _OPS.gguf_linear_int8(x, blocks, ggml_type, k, bias)


def gguf_linear_int8_op() -> Callable[..., torch.Tensor]:
    """`gguf_linear_int8`'s op itself (as `gguf_linear_op`)."""
    op = _OPS.gguf_linear_int8
    return getattr(op, "default", op)


def gguf_linear_int8_many(x: torch.Tensor, blocks: list[torch.Tensor], ggml_types: list[int], k: int,
                          biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`gguf_linear_int8` of `x` with each weight in turn, the same bits, in one call: `x` quantized
    once and each weight's first bytes fetched while the one before finishes (a layer's q, k and v)."""
    return _OPS.gguf_linear_int8_many(x, blocks, ggml_types, k, biases)


def gguf_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-bit activation blocks `gguf_linear_int8` multiplies: x [M, K] float32 → (q int8 [M, K], d and s
    float32 [M, K / 32], each a half widened: the block's scale and d * sum(q))."""
    return _OPS.gguf_quantize_activations(x)


def gguf_quantize_activations_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K-quants' 8-bit activation blocks (llama.cpp's Q8_K): x [M, K] float32 → (q int8 [M, K], d
    float32 [M, K / 256], each 16 values' sum int16 [M, K / 16])."""
    return _OPS.gguf_quantize_activations_k(x)


def float_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` in float32 for many rows (`csrc/float_gemm.cpp`): each output one chain of
    fused multiply-adds in k order, so a row's outputs are alike in any batch."""
    return _OPS.float_gemm(x, weight, bias)


def float_linear_lanes() -> int:
    """The vector width (float32 lanes) `float_linear` was built with here: 8 (AVX2) or 16 (AVX512)."""
    return int(_OPS.float_linear_lanes())


def decode_layers(x: Tensor, cos: Tensor, sin: Tensor, norms: list[Tensor], qk_norms: list[Tensor | None],
                  weights: list[Tensor], biases: list[Tensor | None], kinds: list[int], types: list[int],
                  key_caches: list[Tensor], value_caches: list[Tensor], slot_mapping: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, scale: float, windows: list[int], heads: int, kv_heads: int, head_dim: int,
                  eps: float) -> Tensor:
    """A decode step's layers and final norm in one call (`csrc/decode_layers.cpp`): the decode program's
    ops in its order, each projection by its `kinds` entry (`engine/cpu_decode.Kind`)."""
    return _OPS.decode_layers(x, cos, sin, norms, qk_norms, weights, biases, kinds, types, key_caches, value_caches,
                              slot_mapping, block_tables, seq_lens, scale, windows, heads, kv_heads, head_dim, eps)


def pair_linear_available() -> bool:
    """Whether this build has the k-pairs kernels (`csrc/pair_linear.cpp`: AVX512-BF16)."""
    return bool(_OPS.pair_linear_available())


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] laid out as [N / 32][K / 2][32][2], what `pair_linear` reads: a panel of 32
    output features streams from first byte to last."""
    return _OPS.pack_pairs(weight)


def pair_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 (rows of unit stride) @ the weight `packed` by `pack_pairs` (its `n` output features)
    (+ bias) → [M, n] bf16."""
    return _OPS.pair_linear(x, packed, n, bias)


def pair_silu_mul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) in one pass over `packed`: gate and up interleaved 32 rows at a time,
    then packed by `pack_pairs` → [M, features] bf16 (the same bits as the two products and `silu_mul`)."""
    return _OPS.pair_silu_mul(x, packed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each bf16 row of a contiguous x, times weight, in one pass (`csrc/rowwise.cpp`)."""
    return _OPS.rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of contiguous bf16 tensors in one pass."""
    return _OPS.silu_mul(gate, up)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of contiguous bf16 q and k at the positions `cos` and `sin` were made for."""
    return _OPS.rope(q, k, cos, sin)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Each row's Shannon entropy from contiguous float32 log-probs [N, V], in one read of the rows."""
    return _OPS.entropy_from_logprobs(logp)


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (the first of equal maxima) and its log-softmax value, from contiguous float32
    logits [N, V] in one pass (a greedy step's sampling without a [N, V] log-softmax)."""
    return _OPS.greedy_pick(logits)


def bind_threads(cores: list[int]) -> list[bool]:
    """Pin the intra-op pool's thread i to cores[i] (`csrc/threads.cpp`); whether each one took."""
    return [bool(done) for done in _OPS.bind_threads(cores)]


def install_block_pool(threshold: int, reserve: int) -> bool:
    """Torch's CPU allocator serves blocks of `threshold` bytes or more from a heap of their own
    (`csrc/block_pool.cpp`), within `reserve` bytes of address space; whether it is installed."""
    return bool(_OPS.install_block_pool(threshold, reserve))


def block_pool_stats() -> dict[str, int]:
    """The pool's bytes handed out, free below its top, up to its top and its highest top (what the
    process touched), and made writable; empty when not installed."""
    values = list(_OPS.block_pool_stats()) if available() else []
    return dict(zip(("in_use", "free", "top", "peak", "writable"), values, strict=True)) if values else {}
