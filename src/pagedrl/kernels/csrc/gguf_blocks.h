// The GGUF block formats gguf_linear.cpp reads (GGML's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and
// MXFP4, as ggml-common.h lays them out): each as a block's header read once (`Block`) and its values in
// vectors of float_linear's lanes, computed as `gguf.quants.dequantize` computes them (gguf_linear.cpp
// says why that matters: the quantized products are the dequantized float32 ones, bit for bit).
// Included by gguf_linear.cpp alone.
#pragma once

#include <cstdint>
#include <cstring>

#include "float_lanes.h"

#if defined(__AVX512F__) || defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gguf_blocks {

using pagedrl_cpu::kLanes;
using pagedrl_cpu::Vec;
static_assert(32 % kLanes == 0, "a block's values must fill whole vectors");


inline float half(const uint8_t* p) {  // an IEEE half, exactly (subnormals, inf and NaN included)
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = 113;
    uint32_t m = man;
    while (!(m & 0x400u)) { m <<= 1; --e; }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Each format as a block's header read once (`Block`) and its values in vectors of the lanes, `chunk(c)`
// holding values [c W, c W + W): byte lanes widened to int32, to float32, then gguf's operations.
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Byte lanes widened to int32 and a float broadcast as single instructions (GCC's generic forms of these
// build the vectors lane by lane).
inline Ints widen(const uint8_t* p) {  // kLanes unsigned bytes
#if defined(__AVX512F__)
  return (Ints)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (Ints)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  Ints v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

inline Ints widen_signed(const uint8_t* p) {  // kLanes signed bytes
#if defined(__AVX512F__)
  return (Ints)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (Ints)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  Ints v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<int8_t>(p[i]);
  return v;
#endif
}

inline Vec splat(float v) {  // a broadcast (not 0 + v, which would turn -0 into +0)
#if defined(__AVX512F__)
  return (Vec)_mm512_set1_ps(v);
#elif defined(__AVX__)
  return (Vec)_mm256_set1_ps(v);
#else
  Vec out;
  for (int i = 0; i < kLanes; ++i) out[i] = v;
  return out;
#endif
}

inline Vec to_float(Ints v) { return __builtin_convertvector(v, Vec); }

struct Q8_0 {  // d, then 32 int8: x * d
  static constexpr int kType = 8, kValues = 32, kBytes = 34;
  struct Block {
    const uint8_t* q;
    Vec d;
    explicit Block(const uint8_t* b) : q(b + 2), d(splat(half(b))) {}
    Vec chunk(int c) const { return to_float(widen_signed(q + c * kLanes)) * d; }
  };
};

// Q4_0 and Q4_1: 16 bytes of nibbles, value i being nibble i / 16 of byte i % 16.
inline Ints nibbles32(const uint8_t* q, int c) {
  const int start = c * kLanes;
  return (widen(q + start % 16) >> (4 * (start / 16))) & 15;
}

// With AVX512 a block's 16 possible values are computed once, each as gguf computes it, into one
// register, and every value is then looked up there by its nibble (vpermps reads an index's low 4 bits).
#if defined(__AVX512F__)
inline Vec iota() { return (Vec)_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline Vec lookup(const uint8_t* q, int c, Vec table) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return (Vec)_mm512_permutexvar_ps(c == 0 ? bytes : _mm512_srli_epi32(bytes, 4), (__m512)table);
}
#endif

struct Q4_0 {  // d, nibbles: (q - 8) * d
  static constexpr int kType = 2, kValues = 32, kBytes = 18;
  struct Block {
    const uint8_t* q;
    Vec d;
    explicit Block(const uint8_t* b) : q(b + 2), d(splat(half(b))) {
#if defined(__AVX512F__)
      d = d * (iota() - 8);
#endif
    }
#if defined(__AVX512F__)
    Vec chunk(int c) const { return lookup(q, c, d); }
#else
    Vec chunk(int c) const { return d * to_float(nibbles32(q, c) - 8); }
#endif
  };
};

struct Q4_1 {  // d, m, nibbles: d * q + m (a product rounded, then a sum rounded)
  static constexpr int kType = 3, kValues = 32, kBytes = 20;
  struct Block {
    const uint8_t* q;
    Vec d, m;
    explicit Block(const uint8_t* b) : q(b + 4), d(splat(half(b))), m(splat(half(b + 2))) {
#if defined(__AVX512F__)
      const Vec p = d * iota();
      d = p + m;
#endif
    }
#if defined(__AVX512F__)
    Vec chunk(int c) const { return lookup(q, c, d); }
#else
    Vec chunk(int c) const {
      const Vec p = d * to_float(nibbles32(q, c));
      return p + m;
    }
#endif
  };
};

// Q5_0 and Q5_1: Q4_0's and Q4_1's nibbles with a fifth bit each, bit i of a little-endian uint32 for
// value i. What llama.cpp's Q4_K_M and Q5_K_M fall back to for rows that 256 does not divide.
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
inline Ints fifth_bits(uint32_t qh, int c) {
  Words shifts, word = {};
  for (int i = 0; i < kLanes; ++i) shifts[i] = c * kLanes + i;
  word += qh;  // a broadcast
  return (Ints)((word >> shifts) & 1u);
}

inline uint32_t read_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// With AVX512 a block's 32 possible values are two registers, those of a clear fifth bit and those of a
// set one, each computed as gguf computes it; a value is looked up by its nibble in the first, and where
// its fifth bit is set (the bits of `qh` as a lane mask, no vector shifts) in the second.
#if defined(__AVX512F__)
inline Vec lookup_fifth(const uint8_t* q, int c, uint32_t qh, Vec clear, Vec set) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i nibble = c == 0 ? bytes : _mm512_srli_epi32(bytes, 4);
  const __m512 low = _mm512_permutexvar_ps(nibble, (__m512)clear);
  return (Vec)_mm512_mask_permutexvar_ps(low, static_cast<__mmask16>(qh >> (16 * c)), nibble, (__m512)set);
}
#endif

struct Q5_0 {  // d, fifth bits, nibbles: (q - 16) * d
  static constexpr int kType = 6, kValues = 32, kBytes = 22;
  struct Block {
    const uint8_t* q;
    uint32_t qh;
    Vec d;
#if defined(__AVX512F__)
    Vec set;
    explicit Block(const uint8_t* b) : q(b + 6), qh(read_u32(b + 2)), d(splat(half(b))) {
      set = d * iota();  // q = 16 + nibble
      d = d * (iota() - 16);
    }
    Vec chunk(int c) const { return lookup_fifth(q, c, qh, d, set); }
#else
    explicit Block(const uint8_t* b) : q(b + 6), qh(read_u32(b + 2)), d(splat(half(b))) {}
    Vec chunk(int c) const { return d * to_float((nibbles32(q, c) | (fifth_bits(qh, c) << 4)) - 16); }
#endif
  };
};

struct Q5_1 {  // d, m, fifth bits, nibbles: d * q + m (a product rounded, then a sum rounded)
  static constexpr int kType = 7, kValues = 32, kBytes = 24;
  struct Block {
    const uint8_t* q;
    uint32_t qh;
    Vec d, m;
#if defined(__AVX512F__)
    explicit Block(const uint8_t* b) : q(b + 8), qh(read_u32(b + 4)), d(splat(half(b))), m(splat(half(b + 2))) {
      const Vec low = d * iota(), high = d * (iota() + 16);
      d = low + m;
      m = high + m;
    }
    Vec chunk(int c) const { return lookup_fifth(q, c, qh, d, m); }
#else
    explicit Block(const uint8_t* b) : q(b + 8), qh(read_u32(b + 4)), d(splat(half(b))), m(splat(half(b + 2))) {}
    Vec chunk(int c) const {
      const Vec p = d * to_float(nibbles32(q, c) | (fifth_bits(qh, c) << 4));
      return p + m;
    }
#endif
  };
};

// Q4_K and Q5_K: eight 6-bit scales and mins packed in 12 bytes (gguf's `Q4_K.get_scale_min`), each
// widened as d * scale and dmin * min for its 32 values; 128 bytes of nibbles, sub-block 2c + h being
// nibble h of bytes [32c, 32c + 32).
struct ScalesMins {
  float ds[8], dm[8];
  const uint8_t* q;
  ScalesMins(const uint8_t* b, const uint8_t* qs) : q(qs) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* s = b + 4;
    for (int j = 0; j < 4; ++j) {
      ds[j] = d * static_cast<float>(s[j] & 63);
      dm[j] = dmin * static_cast<float>(s[j + 4] & 63);
      ds[j + 4] = d * static_cast<float>((s[j + 8] & 15) | ((s[j] >> 2) & 0x30));
      dm[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
  }
  Ints nibbles(int start) const {
    const int j = start / 32;
    return (widen(q + 32 * (j / 2) + start % 32) >> (4 * (j % 2))) & 15;
  }
};

struct Q4_K {  // d, dmin, scales, nibbles: ds * q - dm
  static constexpr int kType = 12, kValues = 256, kBytes = 144;
  struct Block : ScalesMins {
    explicit Block(const uint8_t* b) : ScalesMins(b, b + 16) {}
    Vec chunk(int c) const {
      const int start = c * kLanes, j = start / 32;
      const Vec p = splat(ds[j]) * to_float(nibbles(start));
      return p - splat(dm[j]);
    }
  };
};

struct Q5_K {  // d, dmin, scales, 32 bytes of fifth bits (bit j of byte i for sub-block j), nibbles
  static constexpr int kType = 13, kValues = 256, kBytes = 176;
  struct Block : ScalesMins {
    const uint8_t* qh;
    explicit Block(const uint8_t* b) : ScalesMins(b, b + 48), qh(b + 16) {}
    Vec chunk(int c) const {
      const int start = c * kLanes, j = start / 32;
      const Ints v = nibbles(start) | (((widen(qh + start % 32) >> j) & 1) << 4);
      const Vec p = splat(ds[j]) * to_float(v);
      return p - splat(dm[j]);
    }
  };
};

struct Q6_K {  // 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per 16 values), d
  static constexpr int kType = 14, kValues = 256, kBytes = 210;
  struct Block {
    const uint8_t* b;
    float ds[16];
    explicit Block(const uint8_t* p) : b(p) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half(p + 208);
      for (int j = 0; j < 16; ++j) ds[j] = d * static_cast<float>(sc[j]);
    }
    Vec chunk(int c) const {  // value 128 h + 32 s + i: ql[64h + 32(s % 2) + i] >> 4(s / 2), qh[32h + i] >> 2s
      const int start = c * kLanes, h = start / 128, s = start % 128 / 32, i = start % 32;
      const Ints lo = (widen(b + 64 * h + 32 * (s % 2) + i) >> (4 * (s / 2))) & 15;
      const Ints hi = (widen(b + 128 + 32 * h + i) >> (2 * s)) & 3;
      return splat(ds[start / 16]) * to_float((lo | (hi << 4)) - 32);
    }
  };
};

// MXFP4 (gpt-oss's experts): an E8M0 byte e, then 16 bytes of E2M1 nibbles laid out as Q4_0's. A value is
// gguf's `kvalues` entry (the E2M1 value doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) times
// 2^(e - 128) (`e8m0_to_fp32_half`, a float32 subnormal below e = 2): each product is exact (or inf), the
// very number transformers' E2M1 value times 2^(e - 127) gives. A 16-entry table per block, looked up.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct MXFP4 {
  static constexpr int kType = 39, kValues = 32, kBytes = 17;
  struct Block {
    const uint8_t* q;
#if defined(__AVX512F__)
    Vec table;
    explicit Block(const uint8_t* b) : q(b + 1) {
      const Vec kvalues = (Vec)_mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
      table = splat(e8m0_half(b[0])) * kvalues;
    }
    Vec chunk(int c) const { return lookup(q, c, table); }
#else
    float table[16];
    explicit Block(const uint8_t* b) : q(b + 1) {
      static const float kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
      const float d = e8m0_half(b[0]);
      for (int i = 0; i < 16; ++i) table[i] = d * kvalues[i];
    }
    Vec chunk(int c) const {
      const Ints n = nibbles32(q, c);
      Vec v;
      for (int i = 0; i < kLanes; ++i) v[i] = table[n[i]];
      return v;
    }
#endif
  };
};

template <class T>
inline void dequant(const uint8_t* b, float* out) {
  const typename T::Block blk(b);
#pragma GCC unroll 16
  for (int c = 0; c < T::kValues / kLanes; ++c) {
    const Vec v = blk.chunk(c);
    std::memcpy(out + c * kLanes, &v, sizeof(v));
  }
}

}  // namespace gguf_blocks
