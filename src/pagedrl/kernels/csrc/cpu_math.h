// Scalar helpers the CPU kernels share, written so that loops over them vectorize (no calls, no
// branches the compiler cannot turn into selects).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedrl_cpu {

// A bf16 is the top half of a float32's bits.
inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Rounded to the nearest bf16, ties to even (as torch rounds); NaN stays NaN.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// exp(x) for x <= 0 (scores minus their running max) in arithmetic the compiler vectorizes: 2^n * p(r)
// with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error below 2e-7, about
// one float32 ulp). A loop of std::exp stays scalar without -ffast-math, and it was most of the kernel.
inline float exp_nonpositive(float x) {
  // Below -87 exp underflows to a denormal; the rounding toward 0 is harmless here. A plain select, not
  // std::max: GCC reads std::max's reference as control flow and left such loops scalar for AVX2.
  x = x < -87.0f ? -87.0f : x;
  // x log2(e) rounded to the nearest integer, ties to even, as nearbyint would: adding 1.5 * 2^23 leaves
  // no fraction bits, and taking it away again is exact. std::nearbyint itself compiled to a libm call
  // per value when built for AVX2 (no vector loop: 700 us for SiLU of a 48 x 1536 step, 30 with this).
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for exactness
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// 16 bf16 values widened to float32 (exact: a shift; no bf16 instruction).
inline __m512 widen_bf16x16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

inline __m512 load_bf16x16(const uint16_t* p) {
  return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 16 lanes of exp_nonpositive, the same arithmetic step for step.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// float32 rounded to bf16 (nearest, ties to even).
inline __m256i round_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// bf16(bf16(silu(gate)) * up) for 16 bf16 values of each (widened): what `silu_mul` stores, and what
// the fused gate-and-up product stores from its two rounded sums (the same bits by construction).
inline __m256i silu_mul_bf16x16(__m512 gate, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
  const __mmask16 positive = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one), _mm512_add_ps(one, e));
  const __m512 silu = widen_bf16x16(round_bf16x16(_mm512_mul_ps(gate, sigmoid)));
  return round_bf16x16(_mm512_mul_ps(silu, up));
}

#endif

#if defined(__AVX512F__)
// Lane t of the result is the sum of the 16 lanes of v[t]: 16 horizontal sums in 45 shuffles and adds
// (pairs interleaved, then quadruples, then across the 128-bit lanes twice) where one at a time take
// about 140. The additions of each sum happen in the same order whatever the other 15 vectors hold.
inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int j = 0; j < 8; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

}  // namespace pagedrl_cpu
