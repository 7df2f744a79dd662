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

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf_int8_k {

constexpr int kValues = 256;
constexpr int kGroups = kValues / 16;

inline bool is_k_type(int64_t type) { return type == 12 || type == 13 || type == 14; }

inline int block_bytes(int64_t type) { return type == 12 ? 144 : type == 13 ? 176 : 210; }

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

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
    for (int i = 0; i < kValues; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    if (amax == 0.f) {  // (NaN input: fmax drops it, as llama.cpp's `>` does)
      d[at] = 0.f;
      std::memset(out, 0, kValues);
      std::memset(group, 0, kGroups * sizeof(int16_t));
      return;
    }
    int first = 0;
    while (std::fabs(x[first]) != amax) ++first;
    const float iscale = -127.f / x[first];
#if defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(iscale);
    for (int c = 0; c < kValues / 32; ++c) {  // rounded half to even (the default rounding mode)
      __m256i v[4];
      for (int k = 0; k < 4; ++k) v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * c + 8 * k), s));
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
        out[i] = static_cast<int8_t>(std::fmin(127.f, v));
        sum += out[i];
      }
      group[g] = static_cast<int16_t>(sum);
    }
#endif
    d[at] = 1.f / iscale;
  }
};

// ------------------------------------------------------------------ the weight blocks
// One weight block as the integer sums read it.
struct Unpacked {
  alignas(64) uint8_t u[kValues];
  alignas(64) int16_t pair_scale[kValues / 2];  // each pair of values' scale (16 values share one)
  alignas(32) int16_t offset[kGroups];
  float d, dm;
};

// Q4_K and Q5_K's eight 6-bit scales and minimums in 12 bytes (gguf's `Q4_K.get_scale_min`).
inline void scales_mins(const uint8_t* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

inline void spread_scales(const int scale[kGroups], Unpacked* w) {
  for (int g = 0; g < kGroups; ++g)
    for (int i = 0; i < 8; ++i) w->pair_scale[8 * g + i] = static_cast<int16_t>(scale[g]);
}

// Q4_K (`bits` 4: d, dmin, scales, 128 nibble bytes) and Q5_K (`bits` 5: 32 bytes of fifth bits before
// the nibbles): value 64c + 32h + l is nibble h of byte 32c + l, its fifth bit bit 2c + h of byte l.
template <int bits>
inline void unpack_scaled_min(const uint8_t* b, Unpacked* w) {
  const uint8_t* qs = b + (bits == 5 ? 48 : 16);
  const uint8_t* qh = b + 16;
  int sc[8], mn[8], scale[kGroups];
  scales_mins(b + 4, sc, mn);
  for (int g = 0; g < kGroups; ++g) {
    scale[g] = sc[g / 2];
    w->offset[g] = static_cast<int16_t>(mn[g / 2]);
  }
  spread_scales(scale, w);
  w->d = half_at(b);
  w->dm = half_at(b + 2);
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i high = bits == 5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i n[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
    for (int h = 0; h < 2; ++h) {
      if constexpr (bits == 5) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + h)));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
        n[h] = _mm256_or_si256(n[h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(w->u + 64 * c + 32 * h), n[h]);
    }
  }
#else
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        int v = (qs[32 * c + l] >> (4 * h)) & 15;
        if (bits == 5) v |= ((qh[l] >> (2 * c + h)) & 1) << 4;
        w->u[64 * c + 32 * h + l] = static_cast<uint8_t>(v);
      }
#endif
}

// Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d. Value 128H + 32s + i: nibble s / 2
// of ql[64H + 32(s % 2) + i], its high bits bits 2s, 2s + 1 of qh[32H + i].
inline void unpack_q6_k(const uint8_t* b, Unpacked* w) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  int scale[kGroups];
  for (int g = 0; g < kGroups; ++g) {
    scale[g] = sc[g];
    w->offset[g] = static_cast<int16_t>(32 * sc[g]);
  }
  spread_scales(scale, w);
  w->d = w->dm = half_at(b + 208);
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  for (int H = 0; H < 2; ++H) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * H));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * H + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * H));
    const __m256i v[4] = {
        _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)),
        _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(h, top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(h, 2), top))};
    for (int s = 0; s < 4; ++s) _mm256_store_si256(reinterpret_cast<__m256i*>(w->u + 128 * H + 32 * s), v[s]);
  }
#else
  for (int H = 0; H < 2; ++H)
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 32; ++i) {
        const int lo = (b[64 * H + 32 * (s % 2) + i] >> (4 * (s / 2))) & 15;
        const int hi = (b[128 + 32 * H + i] >> (2 * s)) & 3;
        w->u[128 * H + 32 * s + i] = static_cast<uint8_t>(lo | hi << 4);
      }
#endif
}

inline void unpack(int64_t type, const uint8_t* b, Unpacked* w) {
  if (type == 12) unpack_scaled_min<4>(b, w);
  else if (type == 13) unpack_scaled_min<5>(b, w);
  else unpack_q6_k(b, w);
}

// ------------------------------------------------------------------ the integer sums of one block
#if defined(__AVX2__)
inline int32_t sum_lanes(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}
#endif

// si and so (see the top) of weight block `w` and the activation block at `q` with its 16 sums `group`.
// Each `vpmaddubsw` pair is at most 2 * 63 * 127 (no 16-bit saturation), each `vpmaddwd` pair of those
// times a scale at most 2 * 128 * 16002.
inline void block_sums(const Unpacked& w, const int8_t* q, const int16_t* group, int32_t* si, int32_t* so) {
#if defined(__AVX512BW__) && defined(__AVX512F__)
  __m512i acc = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m512i p = _mm512_maddubs_epi16(_mm512_load_si512(w.u + 64 * c), _mm512_loadu_si512(q + 64 * c));
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_load_si512(w.pair_scale + 32 * c)));
  }
  const __m256i total = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  *si = sum_lanes(total);
#elif defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.u + 32 * c)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_load_si256(reinterpret_cast<const __m256i*>(w.pair_scale + 16 * c))));
  }
  *si = sum_lanes(acc);
#else
  int32_t total = 0;
  for (int i = 0; i < kValues; ++i) total += w.pair_scale[i / 2] * (static_cast<int32_t>(w.u[i]) * q[i]);
  *si = total;
#endif
#if defined(__AVX2__)
  *so = sum_lanes(_mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.offset)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group))));
#else
  int32_t offsets = 0;
  for (int g = 0; g < kGroups; ++g) offsets += w.offset[g] * group[g];
  *so = offsets;
#endif
}

// ------------------------------------------------------------------ the products
// Input row m against one weight row unpacked (`w`: its blocks in order).
template <bool kCombined>
inline float row_dot(const Unpacked* w, const SuperRows& a, int64_t m) {
  float sum = 0.f, offsets = 0.f;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t at = m * a.blocks + b;
    int32_t si, so;
    block_sums(w[b], a.q.get() + at * kValues, a.sums.get() + at * kGroups, &si, &so);
    if constexpr (kCombined) {
      sum += (w[b].d * a.d[at]) * static_cast<float>(si - so);
    } else {
      sum += (w[b].d * a.d[at]) * static_cast<float>(si);
      offsets += (w[b].dm * a.d[at]) * static_cast<float>(so);
    }
  }
  return sum - offsets;
}

// Every input row against weight rows [0, N) (`type` a K-quant, `w` [N, ldw] bytes): y [M, N]. Each weight
// row is unpacked once for all input rows (a row's 256-value blocks: 0.9 KB to 1.3 KB unpacked, in L1).
inline void products(const SuperRows& a, int64_t type, const uint8_t* w, int64_t ldw, int64_t N, const float* bias,
                     float* y) {
  const int bytes = block_bytes(type);
  const int64_t grain = std::max<int64_t>(1, 64 / a.M);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<Unpacked> row(a.blocks);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* src = w + n * ldw;
      for (int64_t b = 0; b < a.blocks; ++b) {
        __builtin_prefetch(src + ldw + b * bytes);
        __builtin_prefetch(src + ldw + b * bytes + 64);
        __builtin_prefetch(src + ldw + b * bytes + 128);
        __builtin_prefetch(src + ldw + b * bytes + bytes - 1);
        unpack(type, src + b * bytes, &row[b]);
      }
      const float add = bias ? bias[n] : 0.f;
      for (int64_t m = 0; m < a.M; ++m)
        y[m * N + n] = (type == 14 ? row_dot<true>(row.data(), a, m) : row_dot<false>(row.data(), a, m)) + add;
    }
  });
}

}  // namespace gguf_int8_k
