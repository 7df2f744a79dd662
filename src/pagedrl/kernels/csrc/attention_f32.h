// A float32 chunk's scores and weighted values in whole vectors (AVX512F, or AVX2 with FMA): the row
// kernel's (`attention_rows.h`) inner loops for a float32 cache, as `chunk_scores_bf16` and
// `chunk_values_bf16` are for a bf16 one.
//
// Why: written as portable loops (each key copied to a scratch row, then one dot product per query head
// with its own horizontal sum) a float32 decode row cost about 0.2 us a key per layer (SmolLM2: 9 query
// heads over 3 KV heads of 64): 34 us a layer at 160 keys, 1 ms of a single stream's 12 ms token, and
// most of a batched step's attention. Here each key row is read from the cache straight into registers,
// a query head's 16 position sums come out of one transpose-and-add, and a value row is added to up to
// four heads' accumulators held in registers.
//
// Order: a score is sum_i (q[i] * k[i]) over head_dim in a fixed lane order, the same whichever other
// positions or heads share the call, so a row's result stays the same bit for bit however many rows,
// heads or sequences a call takes (the batch invariance `paged_attention.cpp` states).
//
// A float32 engine may keep its cache in bf16 (`kv_cache_dtype`): the same loops read each key and value
// row widened to float32 on the way into registers (`f32_load` of a bf16 row: a shift, exact), so the
// scores and sums are the float32 ones over the cache's rounded values, at half the bytes a key.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "cpu_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDRL_F32_CHUNKS 1

namespace pagedrl_cpu {

// A key or value row of `bytes` asked for into L2 (the next chunk's, while this one's rows are read).
inline void ask_for_row(const void* row, int bytes) {
  for (int line = 0; line < bytes; line += 64) _mm_prefetch(static_cast<const char*>(row) + line, _MM_HINT_T1);
}

#if defined(__AVX512F__)
using F32Vec = __m512;
constexpr int kF32Lanes = 16;
inline F32Vec f32_zero() { return _mm512_setzero_ps(); }
inline F32Vec f32_load(const float* p) { return _mm512_loadu_ps(p); }
inline F32Vec f32_load(const c10::BFloat16* p) { return load_bf16x16(reinterpret_cast<const uint16_t*>(p)); }
inline void f32_store(float* p, F32Vec v) { _mm512_storeu_ps(p, v); }
inline F32Vec f32_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline F32Vec f32_mul(F32Vec a, F32Vec b) { return _mm512_mul_ps(a, b); }
inline F32Vec f32_add(F32Vec a, F32Vec b) { return _mm512_add_ps(a, b); }
inline F32Vec f32_sub(F32Vec a, F32Vec b) { return _mm512_sub_ps(a, b); }
inline F32Vec f32_max(F32Vec a, F32Vec b) { return _mm512_max_ps(a, b); }
inline F32Vec f32_round(F32Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for lanes holding whole numbers n in [-126, 127].
inline F32Vec f32_pow2(F32Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline F32Vec f32_splat(float x) { return _mm512_set1_ps(x); }

// Lane t: the sum of v[t]'s 16 lanes (`sum_lanes16`).
inline void f32_sum_lanes(F32Vec v[16], float* out) { _mm512_storeu_ps(out, sum_lanes16(v)); }
#else
using F32Vec = __m256;
constexpr int kF32Lanes = 8;
inline F32Vec f32_zero() { return _mm256_setzero_ps(); }
inline F32Vec f32_load(const float* p) { return _mm256_loadu_ps(p); }
inline F32Vec f32_load(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void f32_store(float* p, F32Vec v) { _mm256_storeu_ps(p, v); }
inline F32Vec f32_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline F32Vec f32_mul(F32Vec a, F32Vec b) { return _mm256_mul_ps(a, b); }
inline F32Vec f32_add(F32Vec a, F32Vec b) { return _mm256_add_ps(a, b); }
inline F32Vec f32_sub(F32Vec a, F32Vec b) { return _mm256_sub_ps(a, b); }
inline F32Vec f32_max(F32Vec a, F32Vec b) { return _mm256_max_ps(a, b); }
inline F32Vec f32_round(F32Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F32Vec f32_pow2(F32Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F32Vec f32_splat(float x) { return _mm256_set1_ps(x); }

// Lane t: the sum of v[t]'s 8 lanes, for t in 0..7 and again for 8..15 (horizontal adds of pairs, then
// quadruples, then the two 128-bit halves).
inline void f32_sum_lanes(F32Vec v[16], float* out) {
  for (int half = 0; half < 2; ++half) {
    const F32Vec* w = v + 8 * half;
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(w[4], w[5]), _mm256_hadd_ps(w[6], w[7]));
    _mm256_storeu_ps(out + 8 * half, _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                                                   _mm256_permute2f128_ps(ab, cd, 0x31)));
  }
}
#endif

// exp(x) for lanes x <= 0: `exp_nonpositive`'s 2^n * p(r), a vector of lanes at a time (the polynomial in
// fused multiply-adds, as `exp_nonpositive16`).
inline F32Vec f32_exp_nonpositive(F32Vec x) {
  x = f32_max(x, f32_splat(-87.0f));
  const F32Vec n = f32_round(f32_mul(x, f32_splat(1.44269504088896341f)));
  const F32Vec r = f32_add(f32_sub(x, f32_mul(n, f32_splat(0.693359375f))), f32_mul(n, f32_splat(2.12194440e-4f)));
  F32Vec p = f32_splat(1.f / 720.f);
  p = f32_fma(p, r, f32_splat(1.f / 120.f));
  p = f32_fma(p, r, f32_splat(1.f / 24.f));
  p = f32_fma(p, r, f32_splat(1.f / 6.f));
  p = f32_fma(p, r, f32_splat(0.5f));
  p = f32_fma(p, r, f32_splat(1.f));
  p = f32_fma(p, r, f32_splat(1.f));
  return f32_mul(p, f32_pow2(n));
}

// A chunk's scores for the `groups` query heads of one KV head: query [groups][kD] (already scaled),
// keys at `keys + slots[t] * token_stride` for t < n; positions n..15 score 0 (masked later). The next
// chunk's key rows of this head (`ahead + t * token_stride`, t < ahead_n) are asked for into L2 one
// with each key row the first head reads (a row of this chunk in, a row of the next asked for). C: the
// cache's element, float32 or bf16.
template <int kD, typename C = float>
inline void chunk_scores_f32(const float* query, const C* keys, const int64_t* slots, int64_t n,
                             int64_t token_stride, int64_t groups, float* scores, const C* ahead = nullptr,
                             int64_t ahead_n = 0) {
  constexpr int kV = kD / kF32Lanes;
  for (int64_t g = 0; g < groups; ++g) {
    F32Vec qv[kV];
    for (int i = 0; i < kV; ++i) qv[i] = f32_load(query + g * kD + kF32Lanes * i);
    F32Vec sums[16];
    for (int64_t t = 0; t < 16; ++t) {
      if (g == 0 && t < ahead_n) ask_for_row(ahead + t * token_stride, kD * static_cast<int>(sizeof(C)));
      F32Vec acc = f32_zero();
      if (t < n) {
        const C* k = keys + slots[t] * token_stride;
        for (int i = 0; i < kV; ++i) acc = f32_fma(qv[i], f32_load(k + kF32Lanes * i), acc);
      }
      sums[t] = acc;
    }
    f32_sum_lanes(sums, scores + g * 16);
  }
}

// acc[g] += p[g][t] * v[t] for the chunk's positions in order, kG heads' accumulators in registers:
// with 16 lanes a whole row of each (a value row loaded once for the kG heads); with 8 (AVX2's 16
// registers) one slice of kSlice vectors at a time. Each sum is added in position order either way.
// The next chunk's value rows (`ahead`, as `chunk_scores_f32`'s keys) asked for one a position in the
// first slice's pass.
template <int kD, int kG, typename C = float>
inline void chunk_values_f32_heads(const C* values, const int64_t* slots, int64_t n, int64_t token_stride,
                                   const float* probs, float* acc, const C* ahead = nullptr,
                                   int64_t ahead_n = 0) {
  constexpr int kV = kD / kF32Lanes;
  constexpr int kSlice = kF32Lanes == 16 ? kV : (kV % 2 == 0 ? 2 : 1);
  for (int s = 0; s < kV; s += kSlice) {
    F32Vec a[kG][kSlice];
    for (int g = 0; g < kG; ++g)
      for (int i = 0; i < kSlice; ++i) a[g][i] = f32_load(acc + g * kD + kF32Lanes * (s + i));
    for (int64_t t = 0; t < n; ++t) {
      if (s == 0 && t < ahead_n) ask_for_row(ahead + t * token_stride, kD * static_cast<int>(sizeof(C)));
      const C* v = values + slots[t] * token_stride + kF32Lanes * s;
      F32Vec row[kSlice];
      for (int i = 0; i < kSlice; ++i) row[i] = f32_load(v + kF32Lanes * i);
      for (int g = 0; g < kG; ++g) {
        const F32Vec p = f32_splat(probs[g * 16 + t]);
        for (int i = 0; i < kSlice; ++i) a[g][i] = f32_fma(p, row[i], a[g][i]);
      }
    }
    for (int g = 0; g < kG; ++g)
      for (int i = 0; i < kSlice; ++i) f32_store(acc + g * kD + kF32Lanes * (s + i), a[g][i]);
  }
}

// Heads up to four at a time.
template <int kD, typename C = float>
inline void chunk_values_f32(const C* values, const int64_t* slots, int64_t n, int64_t token_stride,
                             int64_t groups, const float* probs, float* acc, const C* ahead = nullptr,
                             int64_t ahead_n = 0) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4, ahead_n = 0)
    chunk_values_f32_heads<kD, 4, C>(values, slots, n, token_stride, probs + g * 16, acc + g * kD, ahead, ahead_n);
  switch (groups - g) {
    case 3: chunk_values_f32_heads<kD, 3, C>(values, slots, n, token_stride, probs + g * 16, acc + g * kD, ahead, ahead_n); break;
    case 2: chunk_values_f32_heads<kD, 2, C>(values, slots, n, token_stride, probs + g * 16, acc + g * kD, ahead, ahead_n); break;
    case 1: chunk_values_f32_heads<kD, 1, C>(values, slots, n, token_stride, probs + g * 16, acc + g * kD, ahead, ahead_n); break;
    default: break;
  }
}

}  // namespace pagedrl_cpu

#else
#define PAGEDRL_F32_CHUNKS 0
#endif
