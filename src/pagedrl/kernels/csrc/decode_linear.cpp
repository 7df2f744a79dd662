// A linear layer's product for the few rows of a decode step, in bf16 (CPU with AVX512-BF16).
//
// Why: at a few rows a projection is a pass over its weights, and the model's weights (270 MB in bf16
// for the default model) are read once per step. oneDNN's bf16 kernel reads them at 9-11 GB/s on this
// project's machine at 1-16 rows, about half its memory bandwidth, and a decode step is mostly that.
// Here each output feature's weight row is streamed once per step with the dot-product instruction
// `vdpbf16ps` (32 bf16 products into 16 float32 sums per instruction) against every input row, held in
// registers as tiles of up to 2 input rows x 8 weight rows.
//
// Every output element is the float32 sum of its K products, accumulated 32 at a time into one vector
// in k order and its lanes reduced at the end by one tree (`sum_lanes16`), whatever the tile or the
// number of rows; the result is rounded to bf16 once (after the bias is added in float32). Weights
// are read in place (the module's own tensor, any row stride), so a weight update needs nothing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDRL_DECODE_LINEAR 1
#else
#define PAGEDRL_DECODE_LINEAR 0
#endif

#if PAGEDRL_DECODE_LINEAR && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDRL_AMX 1
#else
#define PAGEDRL_AMX 0
#endif

namespace {

#if PAGEDRL_DECODE_LINEAR

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// sums[i * NB + j] = sum_k x[i][k] * w[j][k] for MB input rows and NB weight rows (MB * NB <= 16).
// Each sum's 16 lanes are reduced by `sum_lanes16` together with the tile's other sums (unused
// places zero): one tree of additions for every output, whatever the tile, in a third of the
// instructions of one horizontal sum at a time (the kernel's time did not change measurably).
template <int MB, int NB>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float* sums) {
  static_assert(MB * NB <= 16, "a tile's sums are one vector");
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16(w + j * ldw + k);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = load_bf16(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]);
    }
  }
  if (k < K) {  // the last K % 32 products; masked-off lanes load zeros and add nothing
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16(w + j * ldw + k, mask);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = load_bf16(x + i * ldx + k, mask);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]);
    }
  }
  _mm512_storeu_ps(sums, pagedrl_cpu::sum_lanes16(acc));
}

using pagedrl_cpu::float_to_bf16;

// Weight rows [n0, n0 + NB) against every input row, MB rows at a time (the tail one row at a time).
template <int MB, int NB>
void weight_rows(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                 const float* bias, uint16_t* y, int64_t ldy, int64_t n0) {
  alignas(64) float sums[16];
  auto store = [&](int64_t m, int rows) {
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < NB; ++j)
        y[(m + i) * ldy + n0 + j] = float_to_bf16(sums[i * NB + j] + (bias ? bias[n0 + j] : 0.f));
  };
  int64_t m = 0;
  for (; m + MB <= M; m += MB) {
    tile<MB, NB>(x + m * ldx, ldx, w + n0 * ldw, ldw, K, sums);
    store(m, MB);
  }
  for (; m < M; ++m) {
    tile<1, NB>(x + m * ldx, ldx, w + n0 * ldw, ldw, K, sums);
    store(m, 1);
  }
}

#endif  // PAGEDRL_DECODE_LINEAR

#if PAGEDRL_AMX
// AMX: the weights are the tile multiply's left operand as they lie (16 weight rows x 32 of K, read with
// the weight's row stride), the input rows its right operand, packed once per call into the pairs
// layout the instruction reads ([K / 32][16 pairs of k][16 input rows][2]); each tile product adds
// 16 x 16 x 32 products into a 16 x 16 float32 tile (weight rows x input rows). Up to 4 such tiles
// share each weight tile, so the weights stream once per 64 input rows: a decode step's products run
// at memory speed for any batch the engine forms, with no repacked copy of the weights.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux hands out the tile state only to a process that asks for it
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// tmm0..tmm3: sums for input-row blocks mb0..mb0+C-1; tmm4 and tmm5: the weight tile of even and odd
// K blocks; tmm6 and tmm7: input tiles, in turn. Tile registers are not renamed: a load into a tile
// waits for every product still reading it, so with one weight tile the next block's load (from
// memory) would wait for this block's products; with two it overlaps them.
#define PAGEDRL_AMX_STEP(A, kb)                                                               \
  do {                                                                                        \
    _tile_loadd(A, w + (kb) * 32, stride);                                                    \
    const uint16_t* b = packed + (mb0 * k_blocks + (kb)) * 512;                               \
    if (C > 0) { _tile_loadd(6, b, 64); _tile_dpbf16ps(0, A, 6); }                            \
    if (C > 1) { _tile_loadd(7, b + k_blocks * 512, 64); _tile_dpbf16ps(1, A, 7); }           \
    if (C > 2) { _tile_loadd(6, b + 2 * k_blocks * 512, 64); _tile_dpbf16ps(2, A, 6); }       \
    if (C > 3) { _tile_loadd(7, b + 3 * k_blocks * 512, 64); _tile_dpbf16ps(3, A, 7); }       \
  } while (0)

template <int C>
void amx_block(const uint16_t* w, int64_t ldw, const uint16_t* packed, int64_t k_blocks, int64_t mb0, float* sums) {
  if (C > 0) _tile_zero(0);
  if (C > 1) _tile_zero(1);
  if (C > 2) _tile_zero(2);
  if (C > 3) _tile_zero(3);
  const int64_t stride = ldw * 2;
  int64_t kb = 0;
  for (; kb + 2 <= k_blocks; kb += 2) {
    PAGEDRL_AMX_STEP(4, kb);
    PAGEDRL_AMX_STEP(5, kb + 1);
  }
  if (kb < k_blocks) PAGEDRL_AMX_STEP(4, kb);
  if (C > 0) _tile_stored(0, sums, 64);
  if (C > 1) _tile_stored(1, sums + 256, 64);
  if (C > 2) _tile_stored(2, sums + 512, 64);
  if (C > 3) _tile_stored(3, sums + 768, 64);
}
#undef PAGEDRL_AMX_STEP

// r[i][j] <- r[j][i] for a 16 x 16 float32 block: pairs, then quadruples within 128-bit lanes, then the
// 128-bit lanes twice (64 shuffles; 16 gathers of a column cost about four times as much).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// x [M, K] -> [ceil(M / 16)][K / 32][16][16][2], rows past M zero. A block's 16 input rows hold 16
// pairs of k each, and the tile wants them the other way round: a 16 x 16 transpose of 32-bit pairs.
void pack_rows(const uint16_t* x, int64_t M, int64_t ldx, int64_t K, uint16_t* packed) {
  const int64_t k_blocks = K / 32, m_blocks = (M + 15) / 16;
  for (int64_t mb = 0; mb < m_blocks; ++mb) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      __m512 rows[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t m = mb * 16 + i;
        rows[i] = m < M ? _mm512_loadu_ps(x + m * ldx + kb * 32) : _mm512_setzero_ps();
      }
      transpose16(rows);
      float* tile = reinterpret_cast<float*>(packed + (mb * k_blocks + kb) * 512);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + i * 16, rows[i]);
    }
  }
}

// Weight rows [16 nb_begin, 16 nb_end) for every input row.
void amx_rows(const uint16_t* packed, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, const float* bias,
              uint16_t* y, int64_t ldy, int64_t nb_begin, int64_t nb_end) {
  configure_tiles();
  alignas(64) float sums[4 * 256];
  const int64_t k_blocks = K / 32, m_blocks = (M + 15) / 16;
  // Input rows in passes of kPassTiles tiles (256 rows): within a pass this thread's weight tiles are
  // read once per 64 rows from its L2 cache (the weight rows of one thread's share of a projection are
  // at most ~1 MB), and the pass's packed rows stay there too. One pass over all rows read the packed
  // rows again from memory for every 16 weight rows: at 2048 rows 2.5x slower than oneDNN. A pass
  // changes the order of the loops only; every output sums its products as before.
  constexpr int64_t kPassTiles = 16;
  for (int64_t pass = 0; pass < m_blocks; pass += kPassTiles) {
    const int64_t pass_end = std::min(m_blocks, pass + kPassTiles);
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const uint16_t* wb = w + nb * 16 * ldw;
      for (int64_t mb = pass; mb < pass_end; mb += 4) {
        const int64_t count = std::min<int64_t>(4, pass_end - mb);
        switch (count) {
          case 1: amx_block<1>(wb, ldw, packed, k_blocks, mb, sums); break;
          case 2: amx_block<2>(wb, ldw, packed, k_blocks, mb, sums); break;
          case 3: amx_block<3>(wb, ldw, packed, k_blocks, mb, sums); break;
          default: amx_block<4>(wb, ldw, packed, k_blocks, mb, sums); break;
        }
        // A tile holds [weight row][input row]: transposed in registers, each input row's 16 outputs
        // are a row, the bias added in float32 and rounded to bf16 once (to nearest even).
        const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
        for (int64_t c = 0; c < count; ++c) {
          __m512 rows[16];
          for (int n = 0; n < 16; ++n) rows[n] = _mm512_load_ps(sums + c * 256 + n * 16);
          transpose16(rows);
          for (int64_t col = 0; col < 16 && (mb + c) * 16 + col < M; ++col)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + ((mb + c) * 16 + col) * ldy + nb * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(rows[col], b)));
        }
      }
    }
  }
  _tile_release();
}
#endif  // PAGEDRL_AMX

bool decode_linear_available() { return PAGEDRL_DECODE_LINEAR; }

bool decode_linear_amx() {
#if PAGEDRL_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [M, K] bf16, weight [N, K] bf16 (rows may be strided), bias [N] or none -> [M, N] bf16.
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(PAGEDRL_DECODE_LINEAR, "decode_linear: this build has no AVX512-BF16 instructions");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "decode_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "decode_linear: bf16 x and weight expected");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "decode_linear: rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "decode_linear: bias [", N, "] expected");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if PAGEDRL_DECODE_LINEAR
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0), ldw = weight.stride(0);
  int64_t done = 0;  // weight rows computed so far (AMX takes whole tiles of 16)
#if PAGEDRL_AMX
  if (K % 32 == 0 && N >= 16 && amx_permitted()) {
    at::Tensor packed = at::empty({(M + 15) / 16 * 16 * K}, x.options());
    auto* pp = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
    pack_rows(xp, M, ldx, K, pp);
    at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) {
      amx_rows(pp, M, K, wp, ldw, bp, yp, N, begin, end);
    });
    done = N / 16 * 16;
  }
#endif
  // Elsewhere (and for the last N % 16 rows) the dot-product kernel, split by weight rows: each thread
  // streams its own part of the weights, 8 weight rows at a time (kept in L1 while every input row
  // passes), against 2 input rows at a time (16 sums in flight; tiles of 4 x 4 load more input rows
  // from L2 per product and measured 0-10% slower at 8-48 rows).
  constexpr int64_t group = 8;
  const int64_t groups = (N - done) / group;
  at::parallel_for(0, groups, 64 / group, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) weight_rows<2, group>(xp, M, ldx, wp, ldw, K, bp, yp, N, done + g * group);
  });
  for (int64_t n = done + groups * group; n < N; ++n) weight_rows<1, 1>(xp, M, ldx, wp, ldw, K, bp, yp, N, n);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("decode_linear_available() -> bool", &decode_linear_available);
  m.def("decode_linear_amx() -> bool", &decode_linear_amx);
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("decode_linear", &decode_linear); }
