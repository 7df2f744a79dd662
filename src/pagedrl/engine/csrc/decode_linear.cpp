// A linear layer's product for the few rows of a decode step, in bf16 (CPU with AVX512-BF16).
//
// Why: at a few rows a projection is a pass over its weights, and the model's weights (270 MB in bf16
// for the default model) are read once per step. oneDNN's bf16 kernel reads them at 9-11 GB/s on this
// project's machine at 1-16 rows, about half its memory bandwidth, and a decode step is mostly that.
// Here each output feature's weight row is streamed once per step with the dot-product instruction
// `vdpbf16ps` (32 bf16 products into 16 float32 sums per instruction) against every input row, held in
// registers as tiles of up to 4 input rows x 4 weight rows.
//
// Every output element is the float32 sum of its K products, accumulated 32 at a time into one vector
// in k order and reduced at the end, whatever the tile or the number of rows; the result is rounded
// to bf16 once (after the bias is added in float32). Weights are read in place (the module's own
// tensor, any row stride), so a weight update needs nothing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDRL_DECODE_LINEAR 1
#else
#define PAGEDRL_DECODE_LINEAR 0
#endif

namespace {

#if PAGEDRL_DECODE_LINEAR

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[i][j] = sum_k x[i][k] * w[j][k] for MB input rows and NB weight rows.
template <int MB, int NB>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float (*out)[8]) {
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16(w + j * ldw + k);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = load_bf16(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
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
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

inline uint16_t to_bf16_bits(float value) { return c10::BFloat16(value).x; }  // round to nearest even

// Weight rows [n0, n0 + NB) against every input row, MB rows at a time (the tail one row at a time).
template <int MB, int NB>
void weight_rows(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                 const float* bias, uint16_t* y, int64_t ldy, int64_t n0) {
  float sums[MB][8];
  auto store = [&](int64_t m, int rows) {
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < NB; ++j) y[(m + i) * ldy + n0 + j] = to_bf16_bits(sums[i][j] + (bias ? bias[n0 + j] : 0.f));
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

bool decode_linear_available() { return PAGEDRL_DECODE_LINEAR; }

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
  // Work is split by weight rows: each thread streams its own part of the weights. One input row
  // takes 8 weight rows at a time (8 independent sums in flight); more take tiles of 4 x 4.
  const int64_t group = M == 1 ? 8 : 4, groups = N / group;
  at::parallel_for(0, groups, 64 / group, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (M == 1) weight_rows<1, 8>(xp, M, ldx, wp, ldw, K, bp, yp, N, g * group);
      else weight_rows<4, 4>(xp, M, ldx, wp, ldw, K, bp, yp, N, g * group);
    }
  });
  for (int64_t n = groups * group; n < N; ++n) weight_rows<1, 1>(xp, M, ldx, wp, ldw, K, bp, yp, N, n);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("decode_linear_available() -> bool", &decode_linear_available);
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("decode_linear", &decode_linear); }
