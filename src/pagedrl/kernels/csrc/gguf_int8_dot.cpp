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

#include "gguf_int8_groups.h"
#include "gguf_int8_row.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef int8_t Bytes __attribute__((vector_size(32)));     // a block's 32 signed values
typedef uint8_t UBytes __attribute__((vector_size(32)));   // 32 unsigned ones
typedef int32_t Sums __attribute__((vector_size(32)));     // 8 partial sums of 4 products each
typedef float Floats __attribute__((vector_size(32)));

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

inline float to_half(float v) { return static_cast<float>(c10::Half(v)); }  // rounded to nearest even

template <class V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// sum over i of u[i] * s[i] (u unsigned, s signed bytes), four consecutive bytes into each of the 8 lanes,
// added to `init`. Exact: no term or lane can overflow for the operands below (|s| <= 127, u <= 128).
inline Sums dot(Sums init, UBytes u, Bytes s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return (Sums)_mm256_dpbusd_epi32((__m256i)init, (__m256i)u, (__m256i)s);
#elif defined(__AVXVNNI__)
  return (Sums)_mm256_dpbusd_avx_epi32((__m256i)init, (__m256i)u, (__m256i)s);
#elif defined(__AVX2__)  // pairs into int16 (at most 2 * 128 * 127: no saturation), then pairs of those
  const __m256i pairs = _mm256_maddubs_epi16((__m256i)u, (__m256i)s);
  return init + (Sums)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  Sums out = init;
  for (int i = 0; i < 32; ++i) out[i / 4] += static_cast<int32_t>(u[i]) * static_cast<int32_t>(s[i]);
  return out;
#endif
}

inline UBytes magnitude(Bytes w) {  // |w| as unsigned bytes (-128 -> 128)
#if defined(__AVX2__)
  return (UBytes)_mm256_abs_epi8((__m256i)w);
#else
  UBytes out;
  for (int i = 0; i < 32; ++i) out[i] = static_cast<uint8_t>(w[i] < 0 ? -static_cast<int>(w[i]) : w[i]);
  return out;
#endif
}

inline Bytes signed_by(Bytes x, Bytes w) {  // x where w > 0, -x where w < 0, 0 where w == 0
#if defined(__AVX2__)
  return (Bytes)_mm256_sign_epi8((__m256i)x, (__m256i)w);
#else
  Bytes out;
  for (int i = 0; i < 32; ++i) out[i] = static_cast<int8_t>(w[i] > 0 ? x[i] : (w[i] < 0 ? -x[i] : 0));
  return out;
#endif
}

inline UBytes nibbles(const uint8_t* q) {  // 16 bytes: value i is nibble i / 16 of byte i % 16
#if defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return (UBytes)_mm256_and_si256(both, _mm256_set1_epi8(15));
#else
  UBytes out;
  for (int i = 0; i < 16; ++i) {
    out[i] = q[i] & 15;
    out[i + 16] = q[i] >> 4;
  }
  return out;
#endif
}

inline Floats fma8(Floats a, Floats b, Floats c) {
#if defined(__FMA__)
  return (Floats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline Floats splat8(float v) {
  Floats out = {};
  return out + v;
}

inline float sum8(Floats v) {  // a fixed tree
  for (int width = 4; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) v[i] += v[i + width];
  return v[0];
}

// ------------------------------------------------------------------ the activation blocks
// A row's blocks: the 32 int8 values, d widened from its half, s = half(d * sum(q)) widened (Q4_1's
// and Q5_1's minimum term) and the integer sum(q) (the offsets: Q4_0's -8 * sum(q), Q5_0's -16 * sum(q)).
struct ActivationRows {
  int64_t M, K, blocks;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, s;
  std::unique_ptr<int32_t[]> total;

  ActivationRows(const float* x, int64_t M_, int64_t ldx, int64_t K_)
      : M(M_), K(K_), blocks(K_ / 32), q(new int8_t[M_ * K_]), d(new float[M_ * (K_ / 32)]),
        s(new float[M_ * (K_ / 32)]), total(new int32_t[M_ * (K_ / 32)]) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < blocks; ++b) quantize(x + m * ldx + 32 * b, m * blocks + b);
  }

  void quantize(const float* x, int64_t at) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float dv = amax / 127.f, inverse = amax != 0.f ? 127.f / amax : 0.f;
    int8_t* out = q.get() + at * 32;
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) {
      const float v = std::nearbyint(x[i] * inverse);  // the default rounding: half to even
      out[i] = static_cast<int8_t>(v);
      total += out[i];
    }
    d[at] = to_half(dv);
    s[at] = to_half(dv * static_cast<float>(total));
    this->total[at] = total;
  }
};

// ------------------------------------------------------------------ the weight formats
// `Operand` is what a weight block contributes to every row's dot product, read once per block.
struct Q8_0 {
  static constexpr int kType = 8, kBytes = 34;
  struct Operand {
    Bytes w;
    UBytes size;
    float dw;
    explicit Operand(const uint8_t* b) : w(load<Bytes>(b + 2)), size(magnitude(w)), dw(half_at(b)) {}
    Sums sum(const ActivationRows&, int64_t, Bytes x) const { return dot(Sums{}, size, signed_by(x, w)); }
    float minimum_term(const ActivationRows&, int64_t) const { return 0.f; }
  };
  using Strip = gguf_int8_groups::StripQ8_0;
};

inline UBytes five_bits(const uint8_t* qh, const uint8_t* qs) {  // Q5_0 / Q5_1's values 0..31
  UBytes u;
  gguf_int8_groups::unpack_five_bits(qh, qs, reinterpret_cast<uint8_t*>(&u));
  return u;
}

// Q4_0, Q4_1, Q5_0, Q5_1: values that are unsigned bytes u (nibbles, or 5 bits), the value dw * (u - k)
// (Q4_0 k = 8, Q5_0 16) or dw * u + mw (the `_1` types); the block holds the scale, the minimum, (5 bits)
// the 32 fifth bits, then the nibbles. `S`: its strip type (`gguf_int8_groups.h`), which says which.
template <int Type, class S>
struct UnsignedType {
  static constexpr int kType = Type, kBytes = S::kBytes;
  static constexpr bool kFive = S::kBytes == 22 || S::kBytes == 24;
  static constexpr int kHead = S::kMinimum ? 4 : 2;
  struct Operand {
    UBytes u;
    float dw, mw;
    explicit Operand(const uint8_t* b)
        : u(kFive ? five_bits(b + kHead, b + kHead + 4) : nibbles(b + kHead)), dw(half_at(b)),
          mw(S::kMinimum ? half_at(b + 2) : 0.f) {}
    Sums sum(const ActivationRows& a, int64_t at, Bytes x) const {
      Sums init = {};
      if constexpr (S::kOffset != 0) init[0] = -S::kOffset * a.total[at];
      return dot(init, u, x);
    }
    float minimum_term(const ActivationRows& a, int64_t at) const { return S::kMinimum ? mw * a.s[at] : 0.f; }
  };
  using Strip = S;
};

using Q4_0 = UnsignedType<2, gguf_int8_groups::StripQ4_0>;
using Q4_1 = UnsignedType<3, gguf_int8_groups::StripQ4_1>;
using Q5_0 = UnsignedType<6, gguf_int8_groups::StripQ5_0>;
using Q5_1 = UnsignedType<7, gguf_int8_groups::StripQ5_1>;

template <class F>
void with_type(int64_t type, F&& f) {
  switch (type) {
    case Q8_0::kType: return f(Q8_0{});
    case Q4_0::kType: return f(Q4_0{});
    case Q4_1::kType: return f(Q4_1{});
    case Q5_0::kType: return f(Q5_0{});
    case Q5_1::kType: return f(Q5_1{});
    default:
      TORCH_CHECK(false, "gguf_linear_int8: GGML type ", type, " has no int8 activation product; supported: Q8_0 (8), "
                  "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7)");
  }
}

// Rows [m0, m0 + MB) against weight rows [n0, n0 + NB): each weight block read once for the MB rows.
template <class T, int MB, int NB>
inline void tile(const ActivationRows& a, int64_t m0, const uint8_t* w, int64_t ldw, int64_t n0, const float* bias,
                 float* y, int64_t ldy) {
  Floats acc[MB][NB] = {};
  float minimum[MB][NB] = {};
  const uint8_t* wn = w + n0 * ldw;
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

template <class T, int NB>
inline void sequential_rows(const ActivationRows& a, const RowPairs& pairs, const uint8_t* w, int64_t ldw,
                            int64_t n0, const float* bias, float* y) {
  for (int j = 0; j < NB; ++j) {
    const uint8_t* row = w + (n0 + j) * ldw;
    Floats acc[2] = {};
    float minimum = 0.f, paired = 0.f;
    int64_t b = 0;
#if defined(PAGEDRL_INT8_ROW_PAIRS)
    if constexpr (T::Strip::kPairs) {
      gguf_int8_row::pair_dot<typename T::Strip>(pairs, row, &paired, &minimum);
      b = 2 * pairs.pairs;
    }
#else
    (void)pairs;
#endif
    for (; b < a.blocks; ++b) {
      const typename T::Operand op(row + b * T::kBytes);
      const Bytes x = load<Bytes>(a.q.get() + b * 32);
      const Sums s = op.sum(a, b, x);
      acc[b & 1] = fma8(splat8(op.dw * a.d[b]), __builtin_convertvector(s, Floats), acc[b & 1]);
      minimum += op.minimum_term(a, b);
    }
    y[n0 + j] = paired + sum8(acc[0] + acc[1]) + minimum + (bias ? bias[n0 + j] : 0.f);
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

// Rows [m0, M) against weight row n in tiles of kTileRows rows, then one by one.
template <class T>
void tile_rows(const ActivationRows& a, int64_t m0, const uint8_t* w, int64_t ldw, int64_t n, const float* bias,
               float* y, int64_t ldy) {
  int64_t m = m0;
  for (; m + kTileRows <= a.M; m += kTileRows) tile<T, kTileRows, 1>(a, m, w, ldw, n, bias, y, ldy);
  for (; m < a.M; ++m) tile<T, 1, 1>(a, m, w, ldw, n, bias, y, ldy);
}

template <class T>
void all_rows(const ActivationRows& a, const uint8_t* w, int64_t ldw, int64_t N, const float* bias, float* y) {
  using namespace gguf_int8_groups;
  if (a.M == 1) {
    const RowPairs pairs(typename T::Strip{}, a.q.get(), a.d.get(), a.s.get(), a.blocks);
    at::parallel_for(0, N / 4, 16, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) sequential_rows<T, 4>(a, pairs, w, ldw, g * 4, bias, y);
    });
    for (int64_t n = N / 4 * 4; n < N; ++n) sequential_rows<T, 1>(a, pairs, w, ldw, n, bias, y);
    return;
  }
  const int64_t grouped = grouped_rows(a.M);
  std::unique_ptr<RowGroups> groups;
  if (grouped > 0) groups.reset(new RowGroups(a.q.get(), a.d.get(), a.s.get(), a.total.get(), grouped, a.blocks));
  const int64_t strips = (N + kStripRows - 1) / kStripRows;
  at::parallel_for(0, strips, 16, [&](int64_t begin, int64_t end) {
    std::unique_ptr<Strip> strip(grouped > 0 ? new Strip(a.blocks) : nullptr);
    for (int64_t si = begin; si < end; ++si) {
      const int64_t n0 = si * kStripRows;
      const int rows = static_cast<int>(std::min<int64_t>(kStripRows, N - n0));
      if (grouped > 0) {
        strip->fill<typename T::Strip>(w, ldw, n0, rows);
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
      for (int j = 0; j < rows; ++j) tile_rows<T>(a, grouped, w, ldw, n0 + j, bias, y, N);
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& blocks, int64_t K, int bytes) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.stride(1) == 1,
              "gguf_linear_int8: blocks must be uint8 [N, row_bytes] with contiguous rows, got ",
              blocks.scalar_type(), " ", blocks.sizes());
  TORCH_CHECK(K > 0 && K % 32 == 0, "gguf_linear_int8: K = ", K, " is not a positive multiple of 32");
  TORCH_CHECK(blocks.size(1) == K / 32 * bytes, "gguf_linear_int8: rows of K = ", K, " values take ", K / 32 * bytes,
              " bytes, got ", blocks.size(1));
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K && x.stride(1) == 1,
              "gguf_linear_int8: x must be float32 [M, ", K, "] with contiguous rows, got ", x.scalar_type(), " ",
              x.sizes());
}

// x [M, K] float32, blocks [N, row_bytes] uint8 of GGML type `type` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), bias [N] or none
// -> [M, N] float32.
at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t K,
                            const c10::optional<at::Tensor>& bias) {
  at::Tensor y;
  with_type(type, [&](auto t) {
    using T = decltype(t);
    check(x, blocks, K, T::kBytes);
    const int64_t M = x.size(0), N = blocks.size(0);
    at::Tensor bias_c;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                  "gguf_linear_int8: float32 bias [", N, "] expected");
      bias_c = bias->contiguous();
    }
    y = at::empty({M, N}, x.options());
    if (M == 0) return;
    const ActivationRows a(x.data_ptr<float>(), M, x.stride(0), K);
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    const float* bp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    all_rows<T>(a, wp, blocks.stride(0), N, bp, yp);
  });
  return y;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("gguf_linear_int8(Tensor x, Tensor blocks, int type, int K, Tensor? bias) -> Tensor");
  m.def("gguf_quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) {
  m.impl("gguf_linear_int8", &gguf_linear_int8);
  m.impl("gguf_quantize_activations", &gguf_quantize_activations);
}
