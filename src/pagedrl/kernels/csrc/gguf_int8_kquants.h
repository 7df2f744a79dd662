// K-quant weights (Q4_K, Q5_K, Q6_K: blocks of 256 values) multiplied on 8-bit activations as llama.cpp
// multiplies them (`ggml_vec_dot_q4_K_q8_K` and its kin): each input row quantized in blocks of 256 values
// (GGML's Q8_K), then per block an integer sum and a float32 scaling (`gguf_int8_dot.cpp`'s
// `gguf_linear_int8` for these types).
//
// Why: llama.cpp's Q4_K_M and Q5_K_M files store most of a model's projections in these types (all of
// them where the input width is a multiple of 256). On float32 activations their products cost the widen,
// convert and scale of every value (`gguf_linear.cpp`); here 32 weight values and 32 activation bytes meet
// in one `vpmaddubsw`, their sub-blocks' scales in one `vpmaddwd`, as in llama.cpp's x86 kernels.
//
// The numbers (tests/test_gguf_int8_kquants.py holds them against float64 by hand):
// - activations, llama.cpp's `quantize_row_q8_K_ref`: per 256 values, `max` the value of largest magnitude
//   (the first such), iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale (a
//   float32, not a half), and the 16 sums of 16 q each; a block of zeros: d = 0, q = 0;
// - a weight block as unsigned values u (Q4_K nibbles, Q5_K 5 bits, Q6_K 6 bits), a scale per 16 values
//   (Q4_K / Q5_K: the 6-bit scale of its 32 values, Q6_K: its int8 scale) and an offset per 16 values
//   (Q4_K / Q5_K: the 6-bit minimum of its 32; Q6_K: 32 times its scale), so that
//     integer sum   si = sum_g scale_g * sum_{i in g} u_i q_i          (exact: |si| < 2^31)
//     offset sum    so = sum_g offset_g * sum_{i in g} q_i             (the activation's 16 sums)
//   Q4_K / Q5_K: a block adds (dw * dx) * si to one float32 sum and (dmin * dx) * so to another, the row
//   being the first less the second; Q6_K: (dw * dx) * (si - so), its value being dw * scale * (u - 32).
//   The blocks are taken in order, each integer sum made whole before its scaling: a row's result is the
//   same bits whatever the vector width and however many rows share the call.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gguf_int8_groups.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf_int8_k {

constexpr int kValues = 256;
constexpr int kGroups = kValues / 16;

inline bool is_k_type(int64_t type) { return type == 12 || type == 13 || type == 14; }

constexpr int block_bytes(int64_t type) { return type == 12 ? 144 : type == 13 ? 176 : 210; }

using gguf_int8_groups::half_value;

// ------------------------------------------------------------------ the activation blocks (Q8_K)
struct SuperRows {
  int64_t M, K, blocks;
  std::unique_ptr<int8_t[]> q;       // [M, K]
  std::unique_ptr<int16_t[]> sums;   // [M, blocks, 16]: each 16 values' sum
  std::unique_ptr<float[]> d;        // [M, blocks]

  SuperRows(const float* x, int64_t M_, int64_t ldx, int64_t K_)
      : M(M_), K(K_), blocks(K_ / kValues), q(new int8_t[M_ * K_]), sums(new int16_t[M_ * (K_ / kValues) * kGroups]),
        d(new float[M_ * (K_ / kValues)]) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < blocks; ++b) quantize(x + m * ldx + kValues * b, m * blocks + b);
  }

  void quantize(const float* x, int64_t at) {
    int8_t* out = q.get() + at * kValues;
    int16_t* group = sums.get() + at * kGroups;
    float amax = 0.f;
    int first = 0;
#if defined(__AVX2__)
    // (`vmaxps` keeps its second operand where the first is NaN: NaN dropped, as llama.cpp's `>` does)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < kValues; i += 8) top = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), top);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    if (amax != 0.f) {  // the first value of that magnitude
      const __m256 target = _mm256_set1_ps(amax);
      for (int i = 0;; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), target, _CMP_EQ_OQ));
        if (hits) {
          first = i + __builtin_ctz(hits);
          break;
        }
      }
    }
#else
    for (int i = 0; i < kValues; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    while (amax != 0.f && std::fabs(x[first]) != amax) ++first;
#endif
    const float iscale = amax != 0.f ? -127.f / x[first] : 0.f;
    // A block of zeros (or NaN: fmax drops it, as llama.cpp's `>` does), or one so small that its scale
    // overflows (largest magnitude below ~3.7e-37): values 0, d 0.
    if (!std::isfinite(iscale) || iscale == 0.f) {
      d[at] = 0.f;
      std::memset(out, 0, kValues);
      std::memset(group, 0, kGroups * sizeof(int16_t));
      return;
    }
#if defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(iscale);
    for (int c = 0; c < kValues / 32; ++c) {  // rounded half to even (the default rounding mode)
      __m256i v[4];
      for (int k = 0; k < 4; ++k) {  // a NaN value to 0 (llama.cpp's rounding gives it 0)
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(x + 32 * c + 8 * k), s);
        v[k] = _mm256_cvtps_epi32(_mm256_and_ps(scaled, _mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q)));
      }
      // two groups of 16: lanes of v[0] v[1] and of v[2] v[3] summed (packing saturates at 127: llama.cpp's min)
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * c), ordered);
      const __m256i wide = _mm256_maddubs_epi16(_mm256_set1_epi8(1), ordered);  // pairs, as int16
      const __m256i quads = _mm256_madd_epi16(wide, _mm256_set1_epi16(1));       // 8 sums of 4
      int32_t four[8];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(four), quads);
      group[2 * c] = static_cast<int16_t>(four[0] + four[1] + four[2] + four[3]);
      group[2 * c + 1] = static_cast<int16_t>(four[4] + four[5] + four[6] + four[7]);
    }
#else
    for (int g = 0; g < kGroups; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const float v = std::nearbyint(iscale * x[i]);  // the default rounding: half to even
        out[i] = std::isnan(v) ? 0 : static_cast<int8_t>(std::fmin(127.f, v));
        sum += out[i];
      }
      group[g] = static_cast<int16_t>(sum);
    }
#endif
    d[at] = 1.f / iscale;
  }
};

// ------------------------------------------------------------------ the weight blocks
// Q4_K and Q5_K's eight 6-bit scales and minimums in 12 bytes (gguf's `Q4_K.get_scale_min`).
inline void scales_mins(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// A block's scale and offset per 16 values (see the top), and its d and dm.
template <int Type>
inline void decode_scales(const uint8_t* b, int scale[kGroups], int offset[kGroups], float* dw, float* dm) {
  if constexpr (Type == 14) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < kGroups; ++g) scale[g] = sc[g], offset[g] = 32 * sc[g];
    *dw = *dm = half_value(b + 208);
  } else {
    uint8_t sc[8], mn[8];
    scales_mins(b + 4, sc, mn);
    for (int g = 0; g < kGroups; ++g) scale[g] = sc[g / 2], offset[g] = mn[g / 2];
    *dw = half_value(b);
    *dm = half_value(b + 2);
  }
}

// A block decoded to its values too (the portable products, and the lane groups' weight rows without AVX2:
// `gguf_int8_kgroups.h`).
template <int Type>
inline void decode(const uint8_t* b, uint8_t u[kValues], int scale[kGroups], int offset[kGroups], float* dw, float* dm) {
  decode_scales<Type>(b, scale, offset, dw, dm);
  if constexpr (Type == 14) {
    for (int H = 0; H < 2; ++H)
      for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 32; ++i)
          u[128 * H + 32 * s + i] = static_cast<uint8_t>(((b[64 * H + 32 * (s % 2) + i] >> (4 * (s / 2))) & 15) |
                                                         (((b[128 + 32 * H + i] >> (2 * s)) & 3) << 4));
  } else {
    const uint8_t* qs = b + (Type == 13 ? 48 : 16);
    for (int p = 0; p < 4; ++p)
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l)
          u[64 * p + 32 * h + l] = static_cast<uint8_t>(((qs[32 * p + l] >> (4 * h)) & 15) |
                                                        (Type == 13 ? ((b[16 + l] >> (2 * p + h)) & 1) << 4 : 0));
  }
}

#if defined(__AVX2__)
// `scales_mins` as one vector, the 8 scales in bytes 0-7 and the 8 minimums in 8-15, made in 32-bit words
// (llama.cpp's own shuffle): 16 bytes stored one by one and loaded as a vector stall the load.
inline __m128i scales_mins_vector(const uint8_t* s) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  return _mm_setr_epi32(static_cast<int>(w[0] & six), static_cast<int>((w[2] & four) | (((w[0] >> 6) & two) << 4)),
                        static_cast<int>(w[1] & six), static_cast<int>(((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4)));
}

typedef __m256i Lanes;  // 8 int32 sums; lane j of a 32-value chunk holds its values 4j .. 4j + 3

// A block decoded chunk by chunk in registers: `f(c, u, scale)` for chunk c = 0..7 (values 32c .. 32c + 31)
// with u its unsigned values and scale 16 int16 lanes, lanes 0-7 the scale of values 32c .. 32c + 15,
// 8-15 of the next 16 (one `vpmaddwd` operand for the `vpmaddubsw` pairs); returns the offsets' 16 int16
// lanes (per 16 values: Q4_K / Q5_K each minimum twice, Q6_K its scale, times 32 later).
template <int Type, class F>
inline __m256i for_chunks(const uint8_t* b, F&& f) {
  const __m256i low = _mm256_set1_epi8(15);
  if constexpr (Type == 14) {  // Q6_K: value 128H + 32s + i: nibble s / 2 of ql[64H + 32(s % 2) + i], bits 2s of qh[32H + i]
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int H = 0; H < 2; ++H) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * H));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * H + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * H));
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(h, top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                          _mm256_and_si256(_mm256_srli_epi16(h, 2), top))};
      for (int s = 0; s < 4; ++s) {
        const int c = 4 * H + s;  // scale bytes 2c (lanes 0-7) and 2c + 1 (8-15), sign-extended
        const __m128i pick = _mm_setr_epi8(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1,
                                           2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
        f(c, u[s], _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick)));
      }
    }
    return _mm256_cvtepi8_epi16(scales);
  } else {  // Q4_K, Q5_K: value 64p + 32h + l is nibble h of byte 32p + l, its fifth bit bit 2p + h of byte l
    const __m128i both = scales_mins_vector(b + 4);
    const uint8_t* qs = b + (Type == 13 ? 48 : 16);
    const __m256i high = Type == 13 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i u[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * p + h;
        if constexpr (Type == 13) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << c));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
          u[h] = _mm256_or_si256(u[h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        f(c, u[h], _mm256_cvtepu8_epi16(_mm_shuffle_epi8(both, _mm_set1_epi8(static_cast<char>(c)))));
      }
    }
    // each minimum twice: lanes 2j, 2j + 1 = mn[j]
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(both, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
  }
}

inline float sum_lanes(__m256 v) {  // a fixed tree
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Input rows [m0, m0 + R) against weight row `w` (`Type`'s blocks in order), each weight block decoded once for
// the R rows: y[i * ldy] for row m0 + i. Per row and block, the 8 lanes' integer sums (scale times values,
// and the offsets against the activation's 16-value sums, each lane exact) become float32 lanes through one
// fused multiply-add of dw * dx (and dm * dx), summed over blocks in order; the lanes' tree at the end.
// Every row's numbers are the same whatever R, and on AVX512 as on AVX2 (its lanes are these).
template <int Type, int R>
inline void rows_dot(const SuperRows& a, int64_t m0, const uint8_t* w, float add, float* y, int64_t ldy) {
  constexpr int bytes = block_bytes(Type);
  __m256 sum[R], offsets[R];
  for (int i = 0; i < R; ++i) sum[i] = offsets[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    __builtin_prefetch(block + 4096);
    __builtin_prefetch(block + 4096 + 64);
    __builtin_prefetch(block + 4096 + 128);
    if constexpr (bytes > 192) __builtin_prefetch(block + 4096 + 192);
    Lanes lanes[R];
    const int8_t* q[R];
    for (int i = 0; i < R; ++i) {
      lanes[i] = _mm256_setzero_si256();
      q[i] = a.q.get() + ((m0 + i) * a.blocks + b) * kValues;
    }
    const __m256i offset = for_chunks<Type>(block, [&](int c, __m256i u, __m256i scale) {
      for (int i = 0; i < R; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[i] + 32 * c));
        lanes[i] = _mm256_add_epi32(lanes[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale));
      }
    });
    const float dw = half_value(Type == 14 ? block + 208 : block), dm = Type == 14 ? dw : half_value(block + 2);
    for (int i = 0; i < R; ++i) {
      const int64_t at = (m0 + i) * a.blocks + b;
      const __m256i group = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums.get() + at * kGroups));
      __m256i so = _mm256_madd_epi16(offset, group);
      if constexpr (Type == 14) {  // dw * scale * (u - 32): the offsets (32 times the scales) taken off in integers
        so = _mm256_slli_epi32(so, 5);
        sum[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d[at]), _mm256_cvtepi32_ps(_mm256_sub_epi32(lanes[i], so)), sum[i]);
      } else {
        sum[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d[at]), _mm256_cvtepi32_ps(lanes[i]), sum[i]);
        offsets[i] = _mm256_fmadd_ps(_mm256_set1_ps(dm * a.d[at]), _mm256_cvtepi32_ps(so), offsets[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) y[i * ldy] = sum_lanes(sum[i]) - sum_lanes(offsets[i]) + add;
}
#else
// The same numbers without AVX2: the 8 lanes summed as the vector code sums them.
template <int Type, int R>
inline void rows_dot(const SuperRows& a, int64_t m0, const uint8_t* w, float add, float* y, int64_t ldy) {
  constexpr int bytes = block_bytes(Type);
  for (int i = 0; i < R; ++i) {
    float sum[8] = {}, offsets[8] = {};
    for (int64_t b = 0; b < a.blocks; ++b) {
      uint8_t u[kValues];
      int scale[kGroups], offset[kGroups];
      float dw, dm;
      decode<Type>(w + b * bytes, u, scale, offset, &dw, &dm);
      const int64_t at = (m0 + i) * a.blocks + b;
      const int8_t* q = a.q.get() + at * kValues;
      const int16_t* group = a.sums.get() + at * kGroups;
      int32_t lanes[8] = {}, so[8] = {};
      for (int v = 0; v < kValues; ++v) lanes[(v % 32) / 4] += scale[v / 16] * (static_cast<int32_t>(u[v]) * q[v]);
      for (int g = 0; g < kGroups; ++g) so[g / 2] += offset[g] * group[g];
      for (int j = 0; j < 8; ++j) {
        if (Type == 14) {
          sum[j] = std::fma(dw * a.d[at], static_cast<float>(lanes[j] - so[j]), sum[j]);
        } else {
          sum[j] = std::fma(dw * a.d[at], static_cast<float>(lanes[j]), sum[j]);
          offsets[j] = std::fma(dm * a.d[at], static_cast<float>(so[j]), offsets[j]);
        }
      }
    }
    auto tree = [](float* v) {
      for (int width = 4; width >= 1; width /= 2)
        for (int j = 0; j < width; ++j) v[j] += v[j + width];
      return v[0];
    };
    y[i * ldy] = tree(sum) - tree(offsets) + add;
  }
}
#endif

// ------------------------------------------------------------------ the products
constexpr int kRowsAtOnce = 4;

// Every input row against weight rows [0, N) of K-quant `Type` (`w` [N, ldw] bytes): y [M, N], each weight
// row's blocks decoded once for every kRowsAtOnce input rows.
template <int Type>
void products(const SuperRows& a, const uint8_t* w, int64_t ldw, int64_t N, const float* bias, float* y) {
  const int64_t grain = std::max<int64_t>(1, 64 / a.M);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * ldw;
      const float add = bias ? bias[n] : 0.f;
      int64_t m = 0;
      for (; m + kRowsAtOnce <= a.M; m += kRowsAtOnce) rows_dot<Type, kRowsAtOnce>(a, m, row, add, y + m * N + n, N);
      switch (a.M - m) {
        case 3: rows_dot<Type, 3>(a, m, row, add, y + m * N + n, N); break;
        case 2: rows_dot<Type, 2>(a, m, row, add, y + m * N + n, N); break;
        case 1: rows_dot<Type, 1>(a, m, row, add, y + m * N + n, N); break;
        default: break;
      }
    }
  });
}

inline void products(const SuperRows& a, int64_t type, const uint8_t* w, int64_t ldw, int64_t N, const float* bias,
                     float* y) {
  if (type == 12) products<12>(a, w, ldw, N, bias, y);
  else if (type == 13) products<13>(a, w, ldw, N, bias, y);
  else products<14>(a, w, ldw, N, bias, y);
}

}  // namespace gguf_int8_k
