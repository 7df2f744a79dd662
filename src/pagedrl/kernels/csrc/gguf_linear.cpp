// GGUF weights kept quantized: a block-quantized weight (GGML's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, its
// blocks as the file stores them) dequantized, or multiplied by a decode step's few float32 rows.
//
// Why: at a few rows a projection is a pass over its weights, so a step runs at the speed the weights
// stream. Q4_1 is 0.5625 bytes a weight against float32's 4: the default model's projections stream 7x
// fewer bytes per step when they stay quantized.
//
// The numbers: every dequantized value is computed as `gguf.quants.dequantize` (the package's numpy
// code, the project's oracle) computes it: half scales widened to float32, then the same float32
// operations in the same order, each rounded (torch builds extensions in ISO C++, where GCC contracts no
// a * b + c into a fused multiply-add, so `d * q + m` is a product rounded, then a sum rounded). And every
// output of `gguf_linear` is the float32 number `float_linear` (`float_linear.cpp`) gives on the
// dequantized weights: its K products summed in the build's W lanes in k order, the lanes added by the
// same fixed tree, then the bias. A block holds 32 or 256 values, so K is a multiple of W and no tail
// arises. So a quantized engine's tokens are the dequantized float32 engine's, bit for bit.
//
// The weights stream once per step: for one or two input rows each weight block is dequantized in
// registers and at once multiplied into the rows' sums; for more rows a tile's weight rows are
// dequantized once into a buffer, which every pair of input rows then reads as `float_linear` would.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <memory>

#include "float_lanes.h"
#include "gguf_blocks.h"

#if defined(__AVX512F__) || defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// ------------------------------------------------------------------ float_linear's arithmetic, as it is
// From `float_lanes.h`, the very operations of `float_linear.cpp` (tests/test_gguf_linear.py pins it).
using pagedrl_cpu::fused;
using pagedrl_cpu::kInputRows;
using pagedrl_cpu::kLanes;
using pagedrl_cpu::kWeightRows;
using pagedrl_cpu::load;
using pagedrl_cpu::sum_lanes;
using pagedrl_cpu::Vec;

// ------------------------------------------------------------------ the block formats (gguf_blocks.h)
using namespace gguf_blocks;  // the formats and their `dequant`: this file's vocabulary

const char* type_name(int64_t type) {  // GGML's numbering (gguf.GGMLQuantizationType)
  static const char* names[] = {"F32",     "F16",    "Q4_0",   "Q4_1",    "Q4_2",  "Q4_3",   "Q5_0",  "Q5_1",
                                "Q8_0",    "Q8_1",   "Q2_K",   "Q3_K",    "Q4_K",  "Q5_K",   "Q6_K",  "Q8_K",
                                "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",  "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
                                "I8",      "I16",    "I32",    "I64",     "F64",   "IQ1_M",  "BF16"};
  if (type == 39) return "MXFP4";
  return type >= 0 && type < static_cast<int64_t>(sizeof(names) / sizeof(names[0])) ? names[type] : "unknown";
}

constexpr const char* kSupported = "Q8_0 (8), Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q4_K (12), Q5_K (13), Q6_K (14), MXFP4 (39)";

// Calls f with a value of the block format `type`.
template <class F>
void with_type(const char* op, int64_t type, F&& f) {
  switch (type) {
    case Q8_0::kType: return f(Q8_0{});
    case Q4_0::kType: return f(Q4_0{});
    case Q4_1::kType: return f(Q4_1{});
    case Q5_0::kType: return f(Q5_0{});
    case Q5_1::kType: return f(Q5_1{});
    case Q4_K::kType: return f(Q4_K{});
    case Q5_K::kType: return f(Q5_K{});
    case Q6_K::kType: return f(Q6_K{});
    case MXFP4::kType: return f(MXFP4{});
    default:
      TORCH_CHECK(false, op, ": GGML type ", type, " (", type_name(type), ") is not supported; supported: ",
                  kSupported);
  }
}

template <class T>
void check_blocks(const char* op, const at::Tensor& blocks, int64_t K) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.stride(1) == 1, op,
              ": blocks must be uint8 [N, row_bytes] with contiguous rows, got ", blocks.scalar_type(), " ",
              blocks.sizes());
  TORCH_CHECK(K > 0 && K % T::kValues == 0, op, ": K = ", K, " is not a positive multiple of ", type_name(T::kType),
              "'s block of ", T::kValues, " values");
  TORCH_CHECK(blocks.size(1) == K / T::kValues * T::kBytes, op, ": ", type_name(T::kType), " rows of K = ", K,
              " values take ", K / T::kValues * T::kBytes, " bytes, got ", blocks.size(1));
}

// Into `out` (float32 [N, K], contiguous): a trainer's frozen base dequantizes every weight twice a step,
// and a fresh 3.5 MB block each time left the kept heap holes that the step's activations could not fill.
void gguf_dequantize_into(const at::Tensor& blocks, int64_t type, int64_t K, const at::Tensor& out) {
  with_type("gguf_dequantize_into", type, [&](auto t) {
    using T = decltype(t);
    check_blocks<T>("gguf_dequantize_into", blocks, K);
    const int64_t N = blocks.size(0), ld = blocks.stride(0), per_row = K / T::kValues;
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                    out.size(1) == K,
                "gguf_dequantize_into: out must be contiguous float32 [", N, ", ", K, "], got ", out.scalar_type(),
                " ", out.sizes());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        for (int64_t b = 0; b < per_row; ++b) dequant<T>(src + n * ld + b * T::kBytes, dst + n * K + b * T::kValues);
    });
  });
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t K) {
  at::Tensor out = at::empty({blocks.size(0), K}, blocks.options().dtype(at::kFloat));
  gguf_dequantize_into(blocks, type, K, out);
  return out;
}

// ------------------------------------------------------------------ the product
// Every cache line of a block: a K-quant's block spans 3 to 4 lines (Q4_K 144 bytes, Q6_K 210), and
// fetching only its first left Q6_K's products streaming at a third of Q4_1's speed.
template <class T>
inline void prefetch_block(const uint8_t* p) {
#pragma GCC unroll 4
  for (int off = 0; off < T::kBytes; off += 64) __builtin_prefetch(p + off);
  if (T::kBytes > 64) __builtin_prefetch(p + T::kBytes - 1);
}

// One or two input rows against NB weight rows: each block of the NB rows dequantized in registers and
// at once multiplied into the MB x NB sums.
template <class T, int MB, int NB>
inline void fused_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K, const float* bias,
                       float* y, int64_t ldy) {
  Vec acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = Vec{};
  for (int64_t b = 0, k0 = 0; k0 < K; ++b, k0 += T::kValues) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {  // each sum still takes its products in k order
      const typename T::Block blk(w + j * ldw + b * T::kBytes);
      // A tile reads its rows' few hundred bytes each, too short for the hardware's prefetcher to start:
      // the next tile's same blocks are fetched while these are summed.
      prefetch_block<T>(w + (NB + j) * ldw + b * T::kBytes);
#pragma GCC unroll 16
      for (int c = 0; c < T::kValues / kLanes; ++c) {
        const Vec wv = blk.chunk(c);
#pragma GCC unroll 2
        for (int i = 0; i < MB; ++i) acc[i][j] = fused(load(x + i * ldx + k0 + c * kLanes), wv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = sum_lanes(acc[i][j]) + (bias ? bias[j] : 0.f);
}

// float_linear's tile on float32 weight rows (K a multiple of the lanes: no tail).
template <int MB, int NB>
inline void float_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, const float* bias,
                       float* y, int64_t ldy) {
  Vec acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = Vec{};
  for (int64_t k = 0; k < K; k += kLanes) {
    Vec wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load(w + j * ldw + k);
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const Vec xv = load(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = fused(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = sum_lanes(acc[i][j]) + (bias ? bias[j] : 0.f);
}

// Weight rows [n0, n0 + NB) against every input row. `rows` is scratch for NB dequantized rows. With
// AVX512 one input row reads the NB weight rows one after another, each from first byte to last: on an
// AMD EPYC (one thread, the default model's 210 projections from memory, `bench/bench_gguf_linear.py`)
// the NB rows' blocks read in turn streamed Q8_0 at 8.9 GB/s, the rows in address order at 13.0 (Q4_1 level,
// 7.4 and 7.3). With AVX2 (8 lanes) a row's one chain of multiply-adds bounds it below the memory's speed
// (Q4_1 4.8 GB/s in address order, 7.1 in turn), so the rows are read in turn there. Each output's sum is
// the same chain either way.
template <class T, int NB>
void weight_rows(const float* x, int64_t M, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K, const float* bias,
                 float* y, int64_t ldy, int64_t n0, float* rows) {
  const uint8_t* wn = w + n0 * ldw;
  const float* bn = bias ? bias + n0 : nullptr;
  if (M <= kInputRows) {
    if (M == kInputRows) {
      fused_tile<T, kInputRows, NB>(x, ldx, wn, ldw, K, bn, y + n0, ldy);
    } else if (kLanes == 16) {  // one row: each weight row from first byte to last (see above)
      for (int j = 0; j < NB; ++j)
        fused_tile<T, 1, 1>(x, ldx, wn + j * ldw, ldw, K, bn ? bn + j : nullptr, y + n0 + j, ldy);
    } else {
      fused_tile<T, 1, NB>(x, ldx, wn, ldw, K, bn, y + n0, ldy);
    }
    return;
  }
  for (int j = 0; j < NB; ++j)
    for (int64_t b = 0; b < K / T::kValues; ++b) {
      prefetch_block<T>(wn + (NB + j) * ldw + b * T::kBytes);  // as in fused_tile
      dequant<T>(wn + j * ldw + b * T::kBytes, rows + j * K + b * T::kValues);
    }
  int64_t m = 0;
  for (; m + kInputRows <= M; m += kInputRows)
    float_tile<kInputRows, NB>(x + m * ldx, ldx, rows, K, K, bn, y + m * ldy + n0, ldy);
  for (; m < M; ++m) float_tile<1, NB>(x + m * ldx, ldx, rows, K, K, bn, y + m * ldy + n0, ldy);
}

// x [M, K] float32 (rows of unit stride), blocks [N, row_bytes] uint8 of GGML type `type`, bias [N] or
// none -> [M, N] float32.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t K,
                       const c10::optional<at::Tensor>& bias) {
  at::Tensor y;
  with_type("gguf_linear", type, [&](auto t) {
    using T = decltype(t);
    check_blocks<T>("gguf_linear", blocks, K);
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K && x.stride(1) == 1,
                "gguf_linear: x must be float32 [M, ", K, "] with contiguous rows, got ", x.scalar_type(), " ",
                x.sizes());
    const int64_t M = x.size(0), N = blocks.size(0);
    at::Tensor bias_c;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                  "gguf_linear: float32 bias [", N, "] expected");
      bias_c = bias->contiguous();
    }
    y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    const float* bp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t ldx = x.stride(0), ldw = blocks.stride(0), groups = N / kWeightRows;
    const size_t scratch = M > kInputRows ? static_cast<size_t>(kWeightRows * K) : 0;  // uninitialized
    at::parallel_for(0, groups, 64 / kWeightRows, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> rows(new float[scratch]);
      for (int64_t g = begin; g < end; ++g)
        weight_rows<T, kWeightRows>(xp, M, ldx, wp, ldw, K, bp, yp, N, g * kWeightRows, rows.get());
    });
    std::unique_ptr<float[]> rows(new float[scratch]);
    for (int64_t n = groups * kWeightRows; n < N; ++n) weight_rows<T, 1>(xp, M, ldx, wp, ldw, K, bp, yp, N, n, rows.get());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("gguf_dequantize(Tensor blocks, int type, int K) -> Tensor");
  m.def("gguf_dequantize_into(Tensor blocks, int type, int K, Tensor(a!) out) -> ()");
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, int K, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) {
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_dequantize_into", &gguf_dequantize_into);
  m.impl("gguf_linear", &gguf_linear);
}
