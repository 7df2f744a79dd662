// A float32 linear layer's product for the few rows of a decode step, on any x86-64 class (AVX2 + FMA,
// AVX512) and wherever GCC's vector extensions compile.
//
// Why: at a few rows a projection is a pass over its weights (540 MB in float32 for the default model,
// read once per step), so a step runs at the speed the weights stream. MKL's float32 GEMM, which torch
// calls for `F.linear`, packs its operands for a large product on every call and reads the weights at
// a fraction of the memory's speed from 2 rows up (`bench/bench_float_linear.py`). Here each weight row
// is streamed once per step as it lies (the module's own tensor, any row stride: no copy, nothing to
// redo after an optimizer step) against every input row, in register tiles of 2 input rows x NB weight
// rows of W-lane fused multiply-adds (W = 16 with AVX512, 8 with AVX2).
//
// Every output is its K products summed in W lanes in k order (the last K % W products as a chunk
// padded with zeros), the lanes added by one fixed tree, then the bias added: the same operations
// whatever the tile, the number of rows or the thread, so a row's outputs do not depend on its batch.
// The lane count is the build's, so two CPU classes may differ in the last bits, as torch's do.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "float_lanes.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using pagedrl_cpu::fused;
using pagedrl_cpu::kInputRows;
using pagedrl_cpu::kLanes;
using pagedrl_cpu::kWeightRows;
using pagedrl_cpu::load;
using pagedrl_cpu::sum_lanes;
using pagedrl_cpu::Vec;

inline Vec load_tail(const float* p, int64_t n) {  // n < kLanes values, zeros after them
  Vec v = {};
  std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(float));
  return v;
}


// y[m, n0 + j] for MB input rows from x and NB weight rows from w, each a chain of fused multiply-adds.
template <int MB, int NB>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, const float* bias, float* y,
                 int64_t ldy, const float* next, int64_t ask_from = 0, int64_t ask_to = INT64_MAX) {
  Vec acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = Vec{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load(w + j * ldw + k);
    if (next != nullptr && k >= ask_from && k < ask_to) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) __builtin_prefetch(next + j * ldw + k);
    }
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const Vec xv = load(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = fused(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    Vec wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load_tail(w + j * ldw + k, K - k);
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const Vec xv = load_tail(x + i * ldx + k, K - k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = fused(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = sum_lanes(acc[i][j]) + (bias ? bias[j] : 0.f);
}

// Weight rows [n0, n0 + NB) against every input row, kInputRows at a time: the weight rows come from
// memory for the first pair and from L1/L2 for the others. The pairs also prefetch the next NB rows,
// one cache line a row per vector step: NB interleaved streams defeat the hardware prefetcher, and a
// one-row product read the default model's LM head at 17-19 GB/s without this and 27-29 with it (one
// thread, AVX512 and AVX2 alike; a plain sum reads it at 40-44). Prefetching two tiles ahead measured
// no better. The asks are shared out over the pairs, each a slice of k, so that they come at the pace
// of the sums: all made by the first pair (the way it was), a burst of them stalled it, and 16 rows of
// the model's products took 91 ms against 74 shared out (one thread, capped to AVX2; `bench/RESULTS.md`).
// One input row reads the weight rows one after another instead, in address order: on another host
// (AMD EPYC, one thread, memory read at 21-26 GB/s) the interleaved tile read the LM head at 14 GB/s
// and the rows in order at 21-22. Each output's sum is the same chain either way.
template <int NB>
void weight_rows(const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw, int64_t K, const float* bias,
                 float* y, int64_t ldy, int64_t n0) {
  const float* wn = w + n0 * ldw;
  const float* bn = bias ? bias + n0 : nullptr;
  if (M == 1) {  // each weight row from first byte to last: the weights in address order
    for (int j = 0; j < NB; ++j) tile<1, 1>(x, ldx, wn + j * ldw, ldw, K, bn ? bn + j : nullptr, y + n0 + j, ldy, nullptr);
    return;
  }
  int64_t m = 0;
  const float* next = wn + NB * ldw;  // the next weight rows, fetched while these are summed
  const int64_t pairs = M / kInputRows, share = (K / kLanes + pairs - 1) / pairs * kLanes;
  for (int64_t p = 0; m + kInputRows <= M; m += kInputRows, ++p)
    tile<kInputRows, NB>(x + m * ldx, ldx, wn, ldw, K, bn, y + m * ldy + n0, ldy, next, p * share, (p + 1) * share);
  for (; m < M; ++m) tile<1, NB>(x + m * ldx, ldx, wn, ldw, K, bn, y + m * ldy + n0, ldy, m == 0 ? next : nullptr);
}

// x [M, K] float32 (rows contiguous), weight [N, K] float32 (rows contiguous, any row stride), bias [N]
// or none -> [M, N] float32.
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "float_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "float_linear: float32 x and weight expected");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "float_linear: rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "float_linear: float32 bias [", N, "] expected");
    bias_c = bias->contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = weight.stride(0);
  const int64_t groups = N / kWeightRows;
  // Each thread streams its own share of the weights (a grain of 64 weight rows: 147 KB at K = 576).
  at::parallel_for(0, groups, 64 / kWeightRows, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) weight_rows<kWeightRows>(xp, M, ldx, wp, ldw, K, bp, yp, N, g * kWeightRows);
  });
  for (int64_t n = groups * kWeightRows; n < N; ++n) weight_rows<1>(xp, M, ldx, wp, ldw, K, bp, yp, N, n);
  return y;
}

int64_t float_linear_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("float_linear_lanes() -> int", &float_linear_lanes);
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("float_linear", &float_linear); }
