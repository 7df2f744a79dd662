// A linear layer's product in bf16 on weights repacked once into k-pairs (CPU with AVX512-BF16, no AMX).
//
// Why: at tens of rows (a decode step of a batch) oneDNN's bf16 kernel reaches 200-300 GFLOP/s of the
// 450 two cores give here, and at 16 rows it streams the weights at 10 GB/s of the 26 the memory gives.
// The instruction `vdpbf16ps` adds, in each of 16 float32 lanes, the products of one pair of bf16 values
// with another pair. With the weights laid out as [N / 32][K / 2][32 output features][2 of k] a panel
// of 32 output features is two vectors per pair of k, read in one pass from first to last byte, and
// an input row's pair (x[k], x[k + 1]) broadcast to every lane multiplies them with no horizontal sum:
// up to 12 input rows x 32 features are 24 vector sums held in registers across all of K.
//
// Every output is the float32 sum of its K products taken pair by pair in k order in one lane, whatever
// the number of rows, the tile a row falls in or the thread: a row's result does not depend on the
// batch (batch-invariant products). The bias is added in float32 and the sum rounded to bf16 once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDRL_PAIR_LINEAR 1
#else
#define PAGEDRL_PAIR_LINEAR 0
#endif

namespace {

constexpr int64_t kPanel = 32;  // output features a panel holds: two vectors of 16 float32 sums
constexpr int kMaxRows = 12;    // input rows a tile holds: 24 sums + 2 weight vectors + 1 pair < 32 registers
constexpr int64_t kRowBlock = 96;  // input rows a work item takes (their pairs stay in L2 across panels)

#if PAGEDRL_PAIR_LINEAR

// A row's pair of inputs (x[2p], x[2p + 1]) in every lane: what `vdpbf16ps` multiplies a panel's pair by.
inline __m512bh row_pair(const uint16_t* row, int64_t p) {
  int32_t pair;
  std::memcpy(&pair, row + 2 * p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// y[0:MR, 0:cols] = x[0:MR] @ panel (+ bias): one panel, MR input rows, all of K.
template <int MR>
inline void panel_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs, const float* bias,
                       uint16_t* y, int64_t ldy, int64_t cols) {
  __m512 lo[MR], hi[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 64);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * 64 + 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = row_pair(x + i * ldx, p);
      lo[i] = _mm512_dpbf16_ps(lo[i], a, w0);
      hi[i] = _mm512_dpbf16_ps(hi[i], a, w1);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __mmask16 m0 = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    _mm256_mask_storeu_epi16(y + i * ldy, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(lo[i], b0)));
    _mm256_mask_storeu_epi16(y + i * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(hi[i], b1)));
  }
}

// tile(m, n) with the count n (1..N) as a compile-time constant.
template <int N, typename Tile>
void tail_tile(int64_t m, int64_t n, Tile& tile) {
  if constexpr (N > 0) {
    if (n == N) tile(m, std::integral_constant<int, N>{});
    else tail_tile<N - 1>(m, n, tile);
  }
}

// Rows [0, rows) in tiles of kMax rows and one smaller tile for the rest: tile(m, n) for the n rows from m.
template <int kMax, typename Tile>
void over_rows(int64_t rows, Tile&& tile) {
  int64_t m = 0;
  for (; m + kMax <= rows; m += kMax) tile(m, std::integral_constant<int, kMax>{});
  if (m < rows) tail_tile<kMax - 1>(m, rows - m, tile);
}

// Rows [0, rows) of x against one panel.
void panel_rows(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel, int64_t pairs,
                const float* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  over_rows<kMaxRows>(rows, [&](int64_t m, auto n) {
    panel_tile<decltype(n)::value>(x + m * ldx, ldx, panel, pairs, bias, y + m * ldy, ldy, cols);
  });
}

constexpr int kMaxGateRows = 6;  // a gate-and-up tile: 6 rows x 2 panels = 24 sums

// out[0:MR, 0:32] = bf16(silu(bf16(x @ gate))) * bf16(x @ up), rounded as `silu_mul` (`rowwise.cpp`)
// rounds the two products it is given: the same bits as the unfused products and `silu_mul`.
template <int MR>
void gate_up_tile(const uint16_t* x, int64_t ldx, const uint16_t* gate, const uint16_t* up, int64_t pairs,
                  uint16_t* y, int64_t ldy) {
  __m512 g[MR][2], u[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) g[i][0] = g[i][1] = u[i][0] = u[i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh g0 = (__m512bh)_mm512_loadu_si512(gate + p * 64);
    const __m512bh g1 = (__m512bh)_mm512_loadu_si512(gate + p * 64 + 32);
    const __m512bh u0 = (__m512bh)_mm512_loadu_si512(up + p * 64);
    const __m512bh u1 = (__m512bh)_mm512_loadu_si512(up + p * 64 + 32);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = row_pair(x + i * ldx, p);
      g[i][0] = _mm512_dpbf16_ps(g[i][0], a, g0);
      g[i][1] = _mm512_dpbf16_ps(g[i][1], a, g1);
      u[i][0] = _mm512_dpbf16_ps(u[i][0], a, u0);
      u[i][1] = _mm512_dpbf16_ps(u[i][1], a, u1);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    for (int half = 0; half < 2; ++half) {
      const __m512 gv = pagedrl_cpu::widen_bf16x16(pagedrl_cpu::round_bf16x16(g[i][half]));
      const __m512 uv = pagedrl_cpu::widen_bf16x16(pagedrl_cpu::round_bf16x16(u[i][half]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ldy + 16 * half), pagedrl_cpu::silu_mul_bf16x16(gv, uv));
    }
}

void gate_up_rows(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* gate, const uint16_t* up,
                  int64_t pairs, uint16_t* y, int64_t ldy) {
  over_rows<kMaxGateRows>(rows, [&](int64_t m, auto n) {
    gate_up_tile<decltype(n)::value>(x + m * ldx, ldx, gate, up, pairs, y + m * ldy, ldy);
  });
}

#endif  // PAGEDRL_PAIR_LINEAR

// Work items (block of rows, panel) for M rows of K inputs over `panels` panels, handed to
// work(m0, rows, panel) across the threads. Blocks of equal size (in whole tiles of `tile` rows):
// threads split the items evenly, so they split the rows evenly (128 rows as 96 + 32 left one thread
// a quarter of the work: 0.7x oneDNN's time, 1.1x when even). Panels innermost: a thread's items walk
// the panels of one row block (its pairs stay in L2), each weight panel read once per row block;
// where every row's pairs fit in L2 (a decode step's rows), panels outermost instead: each weight
// panel streams from memory once for all the blocks (the vocabulary projection of 128-256 rows:
// 0.86x oneDNN's speed the other way round).
template <typename Work>
void over_tiles(int64_t M, int64_t K, int64_t panels, int64_t tile, Work&& work) {
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = ((M + blocks - 1) / blocks + tile - 1) / tile * tile;
  const bool panels_outer = M * K * static_cast<int64_t>(sizeof(uint16_t)) <= (512 << 10);
  at::parallel_for(0, blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = panels_outer ? item % blocks : item / panels, p = panels_outer ? item / blocks : item % panels;
      const int64_t m0 = b * block_rows, rows = std::min(block_rows, M - m0);
      if (rows > 0) work(m0, rows, p);
    }
  });
}

// weight [N, K] bf16 -> [ceil(N / 32), ceil(K / 2), 32, 2] bf16, zeros past N and K.
at::Tensor pack_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_pairs: a bf16 weight [N, K] expected");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  at::Tensor packed = at::zeros({panels, pairs, kPanel, 2}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const uint16_t* row = src + (p * kPanel + j) * K;
        uint16_t* out = dst + p * pairs * kPanel * 2 + j * 2;
        for (int64_t k = 0; k < K; ++k) out[(k / 2) * kPanel * 2 + (k % 2)] = row[k];
      }
  });
  return packed;
}

bool pair_linear_available() { return PAGEDRL_PAIR_LINEAR; }

// x [M, K] bf16 (rows contiguous), packed = pack_pairs(weight [N, K]), bias [N] or none -> [M, N] bf16.
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(PAGEDRL_PAIR_LINEAR, "pair_linear: this build has no AVX512-BF16 instructions");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "pair_linear: x [M, K] bf16 with contiguous rows expected, got ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(3) == 2,
              "pair_linear: a weight from pack_pairs expected");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(K % 2 == 0 && pairs == K / 2 && (N + kPanel - 1) / kPanel == panels,
              "pair_linear: x [", M, ", ", K, "] does not fit a packed weight of ", N, " features and ", pairs, " pairs");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "pair_linear: bias [", N, "] expected");
    bias_f = at::zeros({panels * kPanel}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, N).copy_(*bias);
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if PAGEDRL_PAIR_LINEAR
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0);
  over_tiles(M, K, panels, kMaxRows, [&](int64_t m0, int64_t rows, int64_t p) {
    panel_rows(xp + m0 * ldx, ldx, rows, wp + p * pairs * kPanel * 2, pairs, bp ? bp + p * kPanel : nullptr,
               yp + m0 * N + p * kPanel, N, std::min(kPanel, N - p * kPanel));
  });
#endif
  return y;
}

// An MLP's bf16(silu(x @ gate.T)) * (x @ up.T) in one pass: x [M, K] bf16 (rows contiguous), packed =
// pack_pairs of the gate and up weights [F, K] interleaved 32 rows at a time (F a multiple of 32) ->
// [M, F] bf16. No bias (an MLP with biases takes the products and `silu_mul` apart).
at::Tensor pair_silu_mul(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(PAGEDRL_PAIR_LINEAR, "pair_silu_mul: this build has no AVX512-BF16 instructions");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "pair_silu_mul: x [M, K] bf16 with contiguous rows expected, got ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(0) % 2 == 0 && packed.size(2) == kPanel && packed.size(3) == 2,
              "pair_silu_mul: gate and up weights from pack_pairs, interleaved 32 rows at a time, expected");
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1), panels = packed.size(0) / 2, F = panels * kPanel;
  TORCH_CHECK(K % 2 == 0 && pairs == K / 2, "pair_silu_mul: x [", M, ", ", K, "] does not fit packed weights of ",
              pairs, " pairs");
  at::Tensor y = at::empty({M, F}, x.options());
#if PAGEDRL_PAIR_LINEAR
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const int64_t ldx = x.stride(0), panel_size = pairs * kPanel * 2;
  over_tiles(M, K, panels, kMaxGateRows, [&](int64_t m0, int64_t rows, int64_t p) {
    gate_up_rows(xp + m0 * ldx, ldx, rows, wp + 2 * p * panel_size, wp + (2 * p + 1) * panel_size, pairs,
                 yp + m0 * F + p * kPanel, F);
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("pack_pairs(Tensor weight) -> Tensor", &pack_pairs);
  m.def("pair_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("pair_silu_mul(Tensor x, Tensor packed) -> Tensor");
  m.def("pair_linear_available() -> bool", &pair_linear_available);
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) {
  m.impl("pair_linear", &pair_linear);
  m.impl("pair_silu_mul", &pair_silu_mul);
}
