// What the 8-bit activation products (`gguf_int8_dot.cpp`) are made of: the vector helpers, the activation
// blocks (a row quantized as llama.cpp quantizes it) and each weight format's per-block operand. The numbers
// and their rules are stated at the top of `gguf_int8_dot.cpp`.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "gguf_int8_groups.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf_int8 {

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
// 127 / amax, or 0 where amax is 0 or so small that it overflows (below ~3.7e-37: d is then a half 0, and
// the block's values are 0 rather than saturated).
inline float scale_inverse(float amax) {
  const float inverse = amax != 0.f ? 127.f / amax : 0.f;
  return std::isfinite(inverse) ? inverse : 0.f;
}

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
#if defined(__AVX2__) && defined(__F16C__)
    // the same numbers in 8-lane vectors (a decode step quantizes its input at every product)
    __m256 v[4], top = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + 8 * k);
      top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[k]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float dv = amax / 127.f, inverse = scale_inverse(amax);
    __m256i values[4], sums = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {  // rounded half to even (the default rounding mode)
      values[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inverse)));
      sums = _mm256_add_epi32(sums, values[k]);
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(values[0], values[1]),
                                             _mm256_packs_epi32(values[2], values[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.get() + at * 32),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float dv = amax / 127.f, inverse = scale_inverse(amax);
    int8_t* out = q.get() + at * 32;
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) {
      const float v = std::nearbyint(x[i] * inverse);  // the default rounding: half to even
      out[i] = static_cast<int8_t>(v);
      total += out[i];
    }
#endif
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
                  "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q4_K (12), Q5_K (13), Q6_K (14)");
  }
}

}  // namespace gguf_int8
