// GGUF weights multiplied as llama.cpp multiplies them: each input row quantized to 8 bits in blocks of 32
// values (GGML's Q8_0 and Q8_1 activation blocks), then integer dot products of weight and activation
// blocks, scaled in float32 (`gguf_linear_int8`, the engine's `activations="int8"`).
//
// Why: at a decode step's few rows a float32 product of Q8_0 weights costs four vector instructions per 16
// weights (widen, convert, scale, multiply-add) and runs below the memory's speed; an integer dot product
// takes 32 weight bytes and 32 activation bytes in one instruction (AVX512-VNNI / AVX-VNNI `vpdpbusd`, or
// AVX2's `vpmaddubsw` + `vpmaddwd`), as llama.cpp's own CPU kernels do. The price: the activations are
// rounded to 8 bits, so the outputs are no longer the float32 model's (`gguf_linear.cpp` keeps those).
//
// The numbers (tests/test_gguf_int8.py holds them against float64 by hand): a row's 32 values x with
// amax = max |x| give d = amax / 127 and q = round-half-even(x * (127 / amax)) (0 where amax is 0), the
// rule of llama.cpp's x86 `quantize_row_q8_0` / `quantize_row_q8_1`; d is stored as an IEEE half (and,
// for Q8_1, s = d * sum(q) too), as their blocks store them. A block's integer sum is exact:
//   Q8_0 weights: dw * dx * sum(w q)
//   Q4_0 weights: dw * dx * sum((n - 8) q)
//   Q4_1 weights: dw * dx * sum(n q) + mw * s
//   Q5_0 / Q5_1 weights: as Q4_0 / Q4_1 with 5-bit n (n - 16 for Q5_0)
// (K-quants, Q4_K / Q5_K / Q6_K, on llama.cpp's blocks of 256 activations: `gguf_int8_kquants.h`)
// (dw, mw the weight block's half scale and minimum, dx, s the activation block's halves widened), and the
// blocks' terms are summed in float32 (a fixed order; llama.cpp's own order is its own).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "gguf_int8_groups.h"
#include "gguf_int8_kgroups.h"
#include "gguf_int8_kquants.h"
#include "gguf_int8_row.h"
#include "gguf_int8_rows8.h"
#include "gguf_int8_types.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace gguf_int8;

// Rows [m0, m0 + MB) against weight rows [n0, n0 + NB) (the first at `wn`): each weight block read once
// for the MB rows.
template <class T, int MB, int NB>
inline void tile(const ActivationRows& a, int64_t m0, const uint8_t* wn, int64_t ldw, int64_t n0, const float* bias,
                 float* y, int64_t ldy) {
  Floats acc[MB][NB] = {};
  float minimum[MB][NB] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    Bytes x[MB];
    for (int i = 0; i < MB; ++i) x[i] = load<Bytes>(a.q.get() + ((m0 + i) * a.blocks + b) * 32);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const uint8_t* block = wn + j * ldw + b * T::kBytes;
      __builtin_prefetch(block + 2 * NB * ldw);
      __builtin_prefetch(block + 2 * NB * ldw + T::kBytes - 1);
      const typename T::Operand op(block);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const int64_t at = (m0 + i) * a.blocks + b;
        const Sums s = op.sum(a, at, x[i]);
        acc[i][j] = fma8(splat8(op.dw * a.d[at]), __builtin_convertvector(s, Floats), acc[i][j]);
        minimum[i][j] += op.minimum_term(a, at);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[(m0 + i) * ldy + n0 + j] = sum8(acc[i][j]) + minimum[i][j] + (bias ? bias[n0 + j] : 0.f);
}

// One input row against weight rows [n0, n0 + NB), each row read from first byte to last before the next:
// the weights in address order, one stream for the hardware's prefetcher. Reading the NB rows' blocks in
// turn (as `tile` does, which shares each activation block among them) streamed the default model's Q8_0
// weights at 8.6 GB/s from memory; in address order at 14.6 (one thread, AMD EPYC with AVX512-VNNI, a
// single-thread memory read at 25 GB/s).
// With AVX512-VNNI the row's blocks go two at a time (`gguf_int8_row.h`, the input row prepared once per
// product in `RowPairs`), the odd last block, if any, as below.
#if defined(PAGEDRL_INT8_ROW_PAIRS)
using RowPairs = gguf_int8_row::PairRow;
#else
struct RowPairs {  // nothing to prepare: every block goes one at a time
  template <class S>
  RowPairs(S, const int8_t*, const float*, const float*, int64_t) {}
};
#endif

//
// Each row also asks for the bytes kAhead past it (`Stream`): the hardware's prefetcher alone kept a
// weight read from memory at 12-13 GB/s where the same product from L2 runs at 21-23; asked 4 KiB ahead,
// 14-15 (2 and 8 KiB: less). Past a weight's end the asks go on into the next weight of the same call
// (`gguf_linear_int8_many`), so its first rows do not start cold; with none, into the bytes that follow
// (often the next weight the allocator placed; a prefetch never faults).
constexpr int64_t kAhead = 4096;
constexpr int64_t kAskedRowBytes = 1024;

struct Stream {
  const uint8_t* end;   // one past the weight's last byte
  const uint8_t* next;  // the weight read after it, or nullptr
  bool asks;            // rows short enough to gain

  const uint8_t* ahead(const uint8_t* p) const {
    if (!asks) return nullptr;
    const uint8_t* target = p + kAhead;
    if (target < end || !next) return target;  // (a prefetch never faults)
    return next + (target - end);
  }
};

template <class T, int NB>
inline void sequential_rows(const ActivationRows& a, const RowPairs& pairs, const uint8_t* w, int64_t ldw,
                            int64_t n0, const float* bias, float* y, const Stream& stream) {
  for (int j = 0; j < NB; ++j) {
    const uint8_t* row = w + (n0 + j) * ldw;
    const uint8_t* ahead = stream.ahead(row);
    float minimum = 0.f, paired = 0.f;
    int64_t b = 0;
#if defined(PAGEDRL_INT8_ROW_PAIRS)
    if constexpr (T::Strip::kPairs) {
      gguf_int8_row::pair_dot<typename T::Strip>(pairs, row, ahead, &paired, &minimum);
      b = 2 * pairs.pairs;
    }
#else
    (void)pairs;
#endif
    // Even blocks into one sum, odd into the other; two blocks a turn, so that each sum stays in a register
    // (indexed by b & 1 they went through memory: a store and a load in every block's chain).
    Floats even = {}, odd = {};
    auto step = [&](int64_t at, Floats& sum) {
      if (ahead) __builtin_prefetch(ahead + at * T::kBytes);
      const typename T::Operand op(row + at * T::kBytes);
      const Sums s = op.sum(a, at, load<Bytes>(a.q.get() + at * 32));
      sum = fma8(splat8(op.dw * a.d[at]), __builtin_convertvector(s, Floats), sum);
      minimum += op.minimum_term(a, at);
    };
    for (; b + 1 < a.blocks; b += 2) {
      step(b, even);
      step(b + 1, odd);
    }
    if (b < a.blocks) step(b, even);
    y[n0 + j] = paired + sum8(even + odd) + minimum + (bias ? bias[n0 + j] : 0.f);
  }
}

// The few rows the lane groups leave: tiles of kTileRows rows against one weight row, each weight block read
// once for them.
#if defined(__AVX512F__)
constexpr int kTileRows = 4;  // 16 sums + 4 activation vectors + operands of 32 registers
#else
constexpr int kTileRows = 2;  // 8 sums of 16 registers
#endif

// How many leading rows go in lane groups (`gguf_int8_groups.h`): all full groups, and a last one padded
// with zero rows where at least kPadRows rows are left: a padded group costs what a full one costs, about
// what 5 to 6 rows cost in tiles (one thread, AVX512-VNNI, the default model's Q8_0 and Q4_1 projections:
// 4 rows 17 ms in tiles, 7 rows 31; a group of 16 rows 27-29).
constexpr int64_t kPadRows = gguf_int8_groups::kLanes * 3 / 8;

inline int64_t grouped_rows(int64_t M) {
  const int64_t full = M / gguf_int8_groups::kLanes * gguf_int8_groups::kLanes;
  return M - full >= kPadRows ? M : full;
}

// Rows [m0, M) against weight row n (at `wn`) in tiles of kTileRows rows, then one by one.
template <class T>
void tile_rows(const ActivationRows& a, int64_t m0, const uint8_t* wn, int64_t ldw, int64_t n, const float* bias,
               float* y, int64_t ldy) {
  int64_t m = m0;
  for (; m + kTileRows <= a.M; m += kTileRows) tile<T, kTileRows, 1>(a, m, wn, ldw, n, bias, y, ldy);
  for (; m < a.M; ++m) tile<T, 1, 1>(a, m, wn, ldw, n, bias, y, ldy);
}

// Weight rows [n0, n0 + rows) (the first at `wn`, rows <= kStripRows) against all input rows: the first
// `grouped` in lane groups through `strip`, the rest in tiles; y [M, N].
template <class T>
void strip_rows(const ActivationRows& a, const gguf_int8_groups::RowGroups* groups, gguf_int8_groups::Strip* strip,
                int64_t grouped, const uint8_t* wn, int64_t ldw, int64_t n0, int rows, int64_t N, const float* bias,
                float* y) {
  using namespace gguf_int8_groups;
  if (grouped > 0) {
    strip->fill<typename T::Strip>(wn, ldw, rows);
    for (int64_t g = 0; g < groups->groups; ++g) {
      LaneFloats out[kStripRows];
      group_strip<typename T::Strip>(*groups, *strip, g, out);
      const int64_t lanes = std::min<int64_t>(kLanes, grouped - g * kLanes);
      for (int j = 0; j < rows; ++j) {
        const float b = bias ? bias[n0 + j] : 0.f;
        for (int64_t l = 0; l < lanes; ++l) y[(g * kLanes + l) * N + n0 + j] = out[j][l] + b;
      }
    }
  }
  for (int j = 0; j < rows; ++j) tile_rows<T>(a, grouped, wn + j * ldw, ldw, n0 + j, bias, y, N);
}

constexpr int kRows8 = gguf_int8_rows8::kRows;

#if defined(PAGEDRL_INT8_ROWS8)
// Where the group steps beat the lane groups (on weights in the `rows8` layout, whose lane groups first
// unpack them). One thread, a 1536 x 576 Q4_1 weight from L3, us at 6 / 16 / 24 / 32 / 64 / 128 input
// rows: AVX512-VNNI, group steps 55 / 153 / 225 / 304 / 599 / -, lane groups (file layout) 140 / 150 / 244
// / 257 / 478 / -: up to 24 rows (31: 288 against 255); AVX2, group steps - / 201 / - / 347 / 689 / 1389, lane
// groups of 8 - / 250 / - / 460 / 891 / 1766: at every row count, input rows taken kInputBlock at a time
// so that their expanded blocks stay in L2.
constexpr int64_t kInputBlock = 32;

inline bool group_steps_win(int64_t rows) {
  return gguf_int8_groups::kLanes == 8 || rows <= gguf_int8_groups::kLanes * 3 / 2;
}

// All input rows against a weight in the `rows8` layout, group by group, kInputBlock input rows at a time
// (the expanded blocks made for each kInputBlock rows in turn: 256 bytes a row and weight block).
template <class S>
void rows8_products(const ActivationRows& a, const uint8_t* w, int64_t ldw, int64_t N, const float* bias, float* y,
                    const Stream& stream) {
  using namespace gguf_int8_rows8;
  for (int64_t first = 0; first < a.M; first += kInputBlock) {
    const int64_t count = std::min(kInputBlock, a.M - first), at = first * a.blocks;
    const Expanded x(a.q.get() + at * 32, count, a.blocks);
    const float *d = a.d.get() + at, *s = a.s.get() + at;
    const int32_t* total = a.total.get() + at;
    at::parallel_for(0, N / kRows, 4, [&](int64_t begin, int64_t end) {
      float out[kMaxInputRows][kRows];
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = w + g * kRows * ldw;
        for (int64_t m0 = 0; m0 < count; m0 += kMaxInputRows) {
          const uint8_t* ahead = first + m0 == 0 ? stream.ahead(group) : nullptr;
          const int rows = static_cast<int>(std::min<int64_t>(kMaxInputRows, count - m0));
          switch (rows) {
            case 1: group_product<S, 1>(x, d, s, total, m0, group, ahead, out); break;
            case 2: group_product<S, 2>(x, d, s, total, m0, group, ahead, out); break;
            case 3: group_product<S, 3>(x, d, s, total, m0, group, ahead, out); break;
            default: group_product<S, 4>(x, d, s, total, m0, group, ahead, out); break;
          }
          for (int i = 0; i < rows; ++i)
            for (int r = 0; r < kRows; ++r)
              y[(first + m0 + i) * N + g * kRows + r] = out[i][r] + (bias ? bias[g * kRows + r] : 0.f);
        }
      }
    });
  }
}
#endif

// `next`: the weight the caller multiplies after this one (one row: its first bytes asked for early).
// `rows8`: the weight is in the `rows8` layout (Q4_0 / Q4_1 / Q5_0 / Q5_1, `gguf_int8_rows8.h`).
template <class T>
void all_rows(const ActivationRows& a, const uint8_t* w, int64_t ldw, int64_t N, const float* bias, float* y,
              const uint8_t* next, bool rows8) {
  using namespace gguf_int8_groups;
#if defined(PAGEDRL_INT8_ROWS8)
  if (rows8 && group_steps_win(a.M)) {
    if constexpr (T::Strip::kRows8)
      return rows8_products<typename T::Strip>(a, w, ldw, N, bias, y, Stream{w + N * ldw, next, true});
  }
#endif
  if (a.M == 1 && !rows8) {
    const RowPairs pairs(typename T::Strip{}, a.q.get(), a.d.get(), a.s.get(), a.blocks);
    const Stream stream{w + N * ldw, next, ldw <= kAskedRowBytes};
    at::parallel_for(0, N / 4, 16, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) sequential_rows<T, 4>(a, pairs, w, ldw, g * 4, bias, y, stream);
    });
    for (int64_t n = N / 4 * 4; n < N; ++n) sequential_rows<T, 1>(a, pairs, w, ldw, n, bias, y, stream);
    return;
  }
  const int64_t grouped = grouped_rows(a.M);
  std::unique_ptr<RowGroups> groups;
  if (grouped > 0) groups.reset(new RowGroups(a.q.get(), a.d.get(), a.s.get(), a.total.get(), grouped, a.blocks));
  if (rows8) {  // each group of 8 rows back in the file's layout, then as below
    at::parallel_for(0, N / kRows8, 2, [&](int64_t begin, int64_t end) {
      std::unique_ptr<Strip> strip(grouped > 0 ? new Strip(a.blocks) : nullptr);
      std::unique_ptr<uint8_t[]> rows(new uint8_t[kRows8 * ldw]);
      for (int64_t g = begin; g < end; ++g) {
        gguf_int8_rows8::unpack_group<typename T::Strip>(w + g * kRows8 * ldw, a.blocks, rows.get(), ldw);
        for (int j = 0; j < kRows8; j += kStripRows)
          strip_rows<T>(a, groups.get(), strip.get(), grouped, rows.get() + j * ldw, ldw, g * kRows8 + j,
                        std::min(kStripRows, kRows8 - j), N, bias, y);
      }
    });
    return;
  }
  const int64_t strips = (N + kStripRows - 1) / kStripRows;
  at::parallel_for(0, strips, 16, [&](int64_t begin, int64_t end) {
    std::unique_ptr<Strip> strip(grouped > 0 ? new Strip(a.blocks) : nullptr);
    for (int64_t si = begin; si < end; ++si) {
      const int64_t n0 = si * kStripRows;
      const int rows = static_cast<int>(std::min<int64_t>(kStripRows, N - n0));
      strip_rows<T>(a, groups.get(), strip.get(), grouped, w + n0 * ldw, ldw, n0, rows, N, bias, y);
    }
  });
}

// `bytes`: a block's, of `values` values.
void check(const at::Tensor& x, const at::Tensor& blocks, int64_t K, int bytes, int values = 32) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.stride(1) == 1,
              "gguf_linear_int8: blocks must be uint8 [N, row_bytes] with contiguous rows, got ",
              blocks.scalar_type(), " ", blocks.sizes());
  TORCH_CHECK(K > 0 && K % 32 == 0, "gguf_linear_int8: K = ", K, " is not a positive multiple of 32");
  TORCH_CHECK(blocks.size(1) == K / values * bytes, "gguf_linear_int8: rows of K = ", K, " values take ", K / values * bytes,
              " bytes, got ", blocks.size(1));
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K && x.stride(1) == 1,
              "gguf_linear_int8: x must be float32 [M, ", K, "] with contiguous rows, got ", x.scalar_type(), " ",
              x.sizes());
}

// A call's input rows quantized as its weights want them, each form made on first use: blocks of 32
// (`ActivationRows`) and of 256 (K-quants, `gguf_int8_k::SuperRows`).
struct Activations {
  const at::Tensor& x;
  int64_t K;
  std::unique_ptr<ActivationRows> rows;
  std::unique_ptr<gguf_int8_k::SuperRows> super;

  Activations(const at::Tensor& x_, int64_t K_) : x(x_), K(K_) {
    TORCH_CHECK(K > 0 && K % 32 == 0, "gguf_linear_int8: K = ", K, " is not a positive multiple of 32");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K && x.stride(1) == 1,
                "gguf_linear_int8: x must be float32 [M, ", K, "] with contiguous rows, got ", x.scalar_type(), " ",
                x.sizes());
  }
  const ActivationRows& blocks32() {
    if (!rows) rows = std::make_unique<ActivationRows>(x.data_ptr<float>(), x.size(0), x.stride(0), K);
    return *rows;
  }
  const gguf_int8_k::SuperRows& blocks256() {
    if (!super) super = std::make_unique<gguf_int8_k::SuperRows>(x.data_ptr<float>(), x.size(0), x.stride(0), K);
    return *super;
  }
};

at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
              "gguf_linear_int8: float32 bias [", N, "] expected");
  return bias->contiguous();
}

// A K-quant weight's product (`gguf_int8_kquants.h`; `rows8`: Q4_K / Q5_K in that layout, `gguf_int8_krows8.h`).
at::Tensor k_product(Activations& a, const at::Tensor& blocks, int64_t type, int64_t K,
                     const c10::optional<at::Tensor>& bias, const uint8_t* next, bool rows8) {
  const char* name = type == 12 ? "Q4_K" : type == 13 ? "Q5_K" : "Q6_K";
  TORCH_CHECK(K % gguf_int8_k::kValues == 0, "gguf_linear_int8: ", name, " rows hold blocks of 256 values; K = ", K,
              " is not a multiple of 256");
  check(a.x, blocks, K, gguf_int8_k::block_bytes(type), gguf_int8_k::kValues);
  TORCH_CHECK(!rows8 || (gguf_int8_krows8::has_layout(type) && blocks.size(0) % kRows8 == 0 &&
                         blocks.stride(0) == blocks.size(1)),
              "gguf_linear_int8: the rows8 layout holds Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K weights of a multiple of 8 "
              "contiguous rows, got ", name, " with ", blocks.size(0), " rows");
  const int64_t M = a.x.size(0), N = blocks.size(0);
  const at::Tensor b = checked_bias(bias, N);
  at::Tensor y = at::empty({M, N}, a.x.options());
  if (M == 0) return y;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const Stream stream{w + N * blocks.stride(0), next, true};
  gguf_int8_kgroups::products(a.blocks256(), type, w, blocks.stride(0), N, b.defined() ? b.data_ptr<float>() : nullptr,
                              y.data_ptr<float>(), rows8, [&](const uint8_t* p) { return stream.ahead(p); });
  return y;
}

// One weight's product (none made when M is 0): [M, N] float32.
// `type`: a GGML type id, plus `gguf_int8_rows8::kLayoutFlag` for a weight in the `rows8` layout.
at::Tensor product(Activations& a, const at::Tensor& blocks, int64_t type, int64_t K,
                   const c10::optional<at::Tensor>& bias, const uint8_t* next) {
  const bool rows8 = type >= gguf_int8_rows8::kLayoutFlag;
  if (rows8) type -= gguf_int8_rows8::kLayoutFlag;
  if (gguf_int8_k::is_k_type(type)) return k_product(a, blocks, type, K, bias, next, rows8);
  at::Tensor y;
  with_type(type, [&](auto t) {
    using T = decltype(t);
    check(a.x, blocks, K, T::kBytes);
    TORCH_CHECK(!rows8 || (T::Strip::kRows8 && blocks.size(0) % kRows8 == 0 &&
                           blocks.stride(0) == blocks.size(1)),
                "gguf_linear_int8: the rows8 layout holds Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K weights of a multiple of 8 "
                "contiguous rows, got type ", type, " with ", blocks.size(0), " rows");
    const int64_t M = a.x.size(0), N = blocks.size(0);
    const at::Tensor b = checked_bias(bias, N);
    y = at::empty({M, N}, a.x.options());
    if (M == 0) return;
    all_rows<T>(a.blocks32(), blocks.data_ptr<uint8_t>(), blocks.stride(0), N, b.defined() ? b.data_ptr<float>() : nullptr,
                y.data_ptr<float>(), next, rows8);
  });
  return y;
}

// x [M, K] float32, blocks [N, row_bytes] uint8 of GGML type `type` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K), bias [N] or none -> [M, N] float32.
at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t K,
                            const c10::optional<at::Tensor>& bias) {
  Activations a(x, K);
  return product(a, blocks, type, K, bias, nullptr);
}

// Several weights over the same input (a layer's q, k and v; its gate and up), each as `gguf_linear_int8`
// computes it, bit for bit: the input rows quantized once, one call from Python, and each weight's first
// bytes asked for while the one before finishes.
std::vector<at::Tensor> gguf_linear_int8_many(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                                              int64_t K, const c10::List<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(types.size() == blocks.size() && biases.size() == blocks.size(),
              "gguf_linear_int8_many: ", blocks.size(), " weights, ", types.size(), " types and ", biases.size(),
              " biases");
  Activations a(x, K);
  std::vector<at::Tensor> out;
  out.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const uint8_t* next = i + 1 < blocks.size() && blocks[i + 1].scalar_type() == at::kByte
                              ? blocks[i + 1].data_ptr<uint8_t>() : nullptr;
    out.push_back(product(a, blocks[i], types[i], K, biases.get(i), next));
  }
  return out;
}

// The activation blocks themselves, for the tests: x [M, K] float32 -> (q int8 [M, K], d [M, K / 32] and
// s [M, K / 32] float32, each a half widened).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0 && x.stride(1) == 1,
              "gguf_quantize_activations: x must be float32 [M, K] with K a multiple of 32 and contiguous rows, got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  const ActivationRows a(x.data_ptr<float>(), M, x.stride(0), K);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / 32}, x.options()), s = at::empty({M, K / 32}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), a.q.get(), M * K);
  std::memcpy(d.data_ptr<float>(), a.d.get(), M * (K / 32) * sizeof(float));
  std::memcpy(s.data_ptr<float>(), a.s.get(), M * (K / 32) * sizeof(float));
  return {q, d, s};
}

// The K-quants' activation blocks (llama.cpp's Q8_K), for the tests: x [M, K] float32 (K a multiple of 256)
// -> (q int8 [M, K], d float32 [M, K / 256], the 16-value sums int16 [M, K / 16]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_activations_k(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 256 == 0 && x.stride(1) == 1,
              "gguf_quantize_activations_k: x must be float32 [M, K] with K a multiple of 256 and contiguous rows, got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  const gguf_int8_k::SuperRows a(x.data_ptr<float>(), M, x.stride(0), K);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, K / 256}, x.options());
  at::Tensor sums = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  std::memcpy(q.data_ptr<int8_t>(), a.q.get(), M * K);
  std::memcpy(d.data_ptr<float>(), a.d.get(), M * (K / 256) * sizeof(float));
  std::memcpy(sums.data_ptr<int16_t>(), a.sums.get(), M * (K / 16) * sizeof(int16_t));
  return {q, d, sums};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("gguf_linear_int8(Tensor x, Tensor blocks, int type, int K, Tensor? bias) -> Tensor");
  m.def("gguf_linear_int8_many(Tensor x, Tensor[] blocks, int[] types, int K, Tensor?[] biases) -> Tensor[]");
  m.def("gguf_quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("gguf_quantize_activations_k(Tensor x) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) {
  m.impl("gguf_linear_int8", &gguf_linear_int8);
  m.impl("gguf_linear_int8_many", &gguf_linear_int8_many);
  m.impl("gguf_quantize_activations", &gguf_quantize_activations);
  m.impl("gguf_quantize_activations_k", &gguf_quantize_activations_k);
}
