// Q4_K / Q5_K weights interleaved eight rows to a group (their `rows8` layout), multiplied on 8-bit
// activations (llama.cpp's Q8_K blocks, `gguf_int8_kquants.h`) up to 4 input rows a step: every product of a
// weight in this layout where AVX2 is built (`gguf_int8_kgroups.h`'s `products`).
//
// Why: one input row against one Q4_K row at a time (`gguf_int8_kquants.h`'s `rows_dot`) ran 10-13 GB/s
// where one thread reads memory at 20-26: per 32 values a scale widened and shuffled, per block two halves
// converted one by one, per row a horizontal sum; a model whose every projection is a K-quant decoded one
// stream at 0.81x llama.cpp. Eight rows interleaved, as llama.cpp's x86 repacking of Q4_K does, make each
// 32-bit lane of a vector one row's: the 8 rows' halves in one load, their 6-bit scales and minimums
// unpacked for all 8 in a few vector operations, each activation run of 4 bytes broadcast against 8 rows,
// and no horizontal sum at all.
//
// The layout: a group (rows 8g .. 8g + 7, the bytes the 8 rows hold in the file's layout) holds per block
// b, in order, 8 * block bytes:
//   [0, 16)      the 8 rows' d (halves)          [16, 32)   their dmin (halves)
//   [32, 96)     byte 8j + r: row r's sub-block j scale, low 4 bits, and its minimum's low 4 bits above
//   [96, 128)    byte 8(j % 4) + r, nibble j / 4: the scale's high 2 bits, the minimum's high 2 bits above
//   Q5_K: [128, 384) for chunk c = 0..7 and row r the row's fifth-bit bytes 4c .. 4c + 3
//   then the nibbles: for pair p = 0..3, chunk c = 0..7 and row r the row's bytes 32p + 4c .. 32p + 4c + 3
//   (low nibbles: values 64p + 4c .., sub-block 2p; high: values 64p + 32 + 4c .., sub-block 2p + 1).
// `unpack_group` gives the rows back in the file's layout (the lane groups and the portable build read that).
//
// The integer sums: with AVX512-VNNI (or AVX-VNNI) `vpdpbusd` makes each sub-block's sum whole in 32 bits
// (at most 32 * 31 * 127), then one `vpmulld` by its scale; with AVX2 `vpmaddubsw` pairs are summed in 16
// bits and `vpmaddwd` multiplies them by the scale duplicated in both halves of each lane. Either way exact.
//
// The numbers: each row's block sums are exact integers, scaled and summed in float32 as the lane groups
// sum them (per block (dw * dx) * si and (dm * dx) * so in fused multiply-adds, the row the first less the
// second): a row's result is the same bits here, in the lane groups, whatever rows share the call.
// `vpmaddubsw` pairs summed in 16 bits: Q4_K 8 chunks (<= 8 * 2 * 15 * 127), Q5_K 4 (<= 4 * 2 * 31 * 127).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_int8_kquants.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf_int8_krows8 {

using gguf_int8_k::block_bytes;
using gguf_int8_k::kGroups;
using gguf_int8_k::kValues;

constexpr int kRows = 8;
constexpr int kLowAt = 32, kHighAt = 96, kFifthAt = 128;

inline bool has_layout(int64_t type) { return type == 12 || type == 13; }

template <int Type>
constexpr int nibbles_at() {
  return Type == 13 ? kFifthAt + 256 : kFifthAt;
}

// A group's 8 rows in the file's layout: out + r * ldw is row r (the group's `blocks` blocks).
template <int Type>
inline void unpack_group(const uint8_t* group, int64_t blocks, uint8_t* out, int64_t ldw) {
  constexpr int bytes = block_bytes(Type);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* g = group + b * kRows * bytes;
    for (int r = 0; r < kRows; ++r) {
      uint8_t* block = out + r * ldw + b * bytes;
      std::memcpy(block, g + 2 * r, 2);
      std::memcpy(block + 2, g + 16 + 2 * r, 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; ++j) {
        const int low = g[kLowAt + 8 * j + r], high = (g[kHighAt + 8 * (j % 4) + r] >> (4 * (j / 4))) & 15;
        sc[j] = static_cast<uint8_t>((low & 15) | (high & 3) << 4);
        mn[j] = static_cast<uint8_t>((low >> 4) | (high >> 2) << 4);
      }
      uint8_t* s = block + 4;  // gguf's `get_scale_min` read backwards
      for (int j = 0; j < 4; ++j) {
        s[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
        s[j + 4] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
        s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
      }
      if constexpr (Type == 13)
        for (int c = 0; c < 8; ++c) std::memcpy(block + 16 + 4 * c, g + kFifthAt + 32 * c + 4 * r, 4);
      uint8_t* qs = block + (Type == 13 ? 48 : 16);
      for (int p = 0; p < 4; ++p)
        for (int c = 0; c < 8; ++c) std::memcpy(qs + 32 * p + 4 * c, g + nibbles_at<Type>() + 256 * p + 32 * c + 4 * r, 4);
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGEDRL_INT8_KROWS8 1

constexpr int kMaxInputRows = 4;  // input rows a step

// Sub-blocks 4h .. 4h + 3's bytes (vector v: byte 8(j % 4) + r) as 16 int16 lanes each, row r's value in
// both halves of 32-bit lane r: a `vpmaddwd` operand against lane r's pairs.
inline void duplicated(__m256i v, __m256i out[4]) {
  const __m256i lo = _mm256_unpacklo_epi8(v, v), hi = _mm256_unpackhi_epi8(v, v);
  out[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
  out[1] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
  out[2] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
  out[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
}

// The same bytes as 8 int32 lanes each (lane r: row r's), the `vpdpbusd` sums' multipliers.
inline void widened(__m256i v, __m256i out[4]) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  out[0] = _mm256_cvtepu8_epi32(lo);
  out[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  out[2] = _mm256_cvtepu8_epi32(hi);
  out[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDRL_KROWS8_DPBUSD(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
#elif defined(__AVXVNNI__)
#define PAGEDRL_KROWS8_DPBUSD(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#endif

inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Q5_K: each byte's bit `bit` of `high` as 16 (bit 4), the rest 0.
inline __m256i fifth(__m256i high, int bit) {
  const __m256i at4 = bit <= 4 ? _mm256_sll_epi16(high, _mm_cvtsi32_si128(4 - bit))
                               : _mm256_srl_epi16(high, _mm_cvtsi32_si128(bit - 4));
  return _mm256_and_si256(at4, _mm256_set1_epi8(16));
}

// Chunk c of pair p, the 8 rows' values as unsigned bytes (lane r: row r's 4): `lo` those of sub-block 2p,
// `hi` of sub-block 2p + 1 (Q5_K's fifth bits added as 16).
template <int Type>
inline void chunk_values(const uint8_t* g, int p, int c, __m256i* lo, __m256i* hi) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + nibbles_at<Type>() + 256 * p + 32 * c));
  *lo = _mm256_and_si256(v, low4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  if constexpr (Type == 13) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + kFifthAt + 32 * c));
    *lo = _mm256_or_si256(*lo, fifth(high, 2 * p));
    *hi = _mm256_or_si256(*hi, fifth(high, 2 * p + 1));
  }
}

// Input rows m0 .. m0 + MB against one group: out[i][r] = row (m0 + i) . weight row (8g + r), without bias.
// `ahead`: where to ask for bytes a block step (nullptr: none).
template <int Type, int MB>
inline void group_product(const gguf_int8_k::SuperRows& a, int64_t m0, const uint8_t* group, const uint8_t* ahead,
                          float out[][kRows]) {
  constexpr int64_t step_bytes = kRows * block_bytes(Type);
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  __m256 acc[MB], offsets[MB];  // lane r: row r's sums over the blocks so far
  for (int i = 0; i < MB; ++i) acc[i] = offsets[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* g = group + b * step_bytes;
    if (ahead)
      for (int64_t line = 0; line < step_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * step_bytes + line), _MM_HINT_T0);
    const __m256i L0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + kLowAt));
    const __m256i L1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + kLowAt + 32));
    const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + kHighAt));
    __m256i scale[8], minimum[8];
    const __m256i sc03 = _mm256_or_si256(_mm256_and_si256(L0, low4), _mm256_and_si256(_mm256_slli_epi16(H, 4), top2));
    const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(L1, low4), _mm256_and_si256(H, top2));
#if defined(PAGEDRL_KROWS8_DPBUSD)  // int32 lanes: each sub-block's 4-value sums made whole by `vpdpbusd`
    widened(sc03, scale);
    widened(sc47, scale + 4);
#else  // int16 lanes, twice: a `vpmaddwd` operand against the `vpmaddubsw` pairs
    duplicated(sc03, scale);
    duplicated(sc47, scale + 4);
#endif
    duplicated(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), low4),
                               _mm256_and_si256(_mm256_slli_epi16(H, 2), top2)), minimum);
    duplicated(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(H, 2), top2)), minimum + 4);
    const int8_t* q[MB];
    __m256i si[MB], so[MB];
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * a.blocks + b;
      q[i] = a.q.get() + at * kValues;
      const int16_t* sums = a.sums.get() + at * kGroups;  // sub-block j: its two 16-value sums, one 32-bit word
      si[i] = _mm256_setzero_si256();
      so[i] = _mm256_madd_epi16(minimum[0], broadcast4(sums));
      for (int j = 1; j < 8; ++j) so[i] = _mm256_add_epi32(so[i], _mm256_madd_epi16(minimum[j], broadcast4(sums + 2 * j)));
    }
#if defined(PAGEDRL_KROWS8_DPBUSD)
    for (int p = 0; p < 4; ++p) {
      __m256i lo_sums[MB], hi_sums[MB];  // lane r: row r's sub-block sums, exact in 32 bits
      for (int i = 0; i < MB; ++i) lo_sums[i] = hi_sums[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        __m256i lo, hi;
        chunk_values<Type>(g, p, c, &lo, &hi);
        for (int i = 0; i < MB; ++i) {
          lo_sums[i] = PAGEDRL_KROWS8_DPBUSD(lo_sums[i], lo, broadcast4(q[i] + 64 * p + 4 * c));
          hi_sums[i] = PAGEDRL_KROWS8_DPBUSD(hi_sums[i], hi, broadcast4(q[i] + 64 * p + 32 + 4 * c));
        }
      }
      for (int i = 0; i < MB; ++i)
        si[i] = _mm256_add_epi32(si[i], _mm256_add_epi32(_mm256_mullo_epi32(lo_sums[i], scale[2 * p]),
                                                         _mm256_mullo_epi32(hi_sums[i], scale[2 * p + 1])));
    }
#else
    for (int p = 0; p < 4; ++p) {
      __m256i lo_pairs[MB], hi_pairs[MB];
      for (int i = 0; i < MB; ++i) lo_pairs[i] = hi_pairs[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        __m256i lo, hi;
        chunk_values<Type>(g, p, c, &lo, &hi);
        for (int i = 0; i < MB; ++i) {
          lo_pairs[i] = _mm256_add_epi16(lo_pairs[i], _mm256_maddubs_epi16(lo, broadcast4(q[i] + 64 * p + 4 * c)));
          hi_pairs[i] = _mm256_add_epi16(hi_pairs[i], _mm256_maddubs_epi16(hi, broadcast4(q[i] + 64 * p + 32 + 4 * c)));
        }
        if (c == 7 || (Type == 13 && c == 3)) {  // widened: Q4_K after 8 chunks, Q5_K after 4
          for (int i = 0; i < MB; ++i) {
            si[i] = _mm256_add_epi32(si[i], _mm256_add_epi32(_mm256_madd_epi16(lo_pairs[i], scale[2 * p]),
                                                             _mm256_madd_epi16(hi_pairs[i], scale[2 * p + 1])));
            lo_pairs[i] = hi_pairs[i] = _mm256_setzero_si256();
          }
        }
      }
    }
#endif
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
    for (int i = 0; i < MB; ++i) {
      const __m256 dx = _mm256_set1_ps(a.d[(m0 + i) * a.blocks + b]);
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(si[i]), acc[i]);
      offsets[i] = _mm256_fmadd_ps(_mm256_mul_ps(dm, dx), _mm256_cvtepi32_ps(so[i]), offsets[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm256_storeu_ps(out[i], _mm256_sub_ps(acc[i], offsets[i]));
}

// All input rows against a weight in this layout, group by group, kMaxInputRows rows a step: y [M, N].
// `ahead(p)`: where to ask for bytes while the group at p is read (nullptr: none).
template <int Type, class Ahead>
void products(const gguf_int8_k::SuperRows& a, const uint8_t* w, int64_t ldw, int64_t N, const float* bias, float* y,
              const Ahead& ahead) {
  at::parallel_for(0, N / kRows, 4, [&](int64_t begin, int64_t end) {
    float out[kMaxInputRows][kRows];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * kRows * ldw;
      for (int64_t m0 = 0; m0 < a.M; m0 += kMaxInputRows) {
        const uint8_t* asked = m0 == 0 ? ahead(group) : nullptr;
        const int rows = static_cast<int>(std::min<int64_t>(kMaxInputRows, a.M - m0));
        switch (rows) {
          case 1: group_product<Type, 1>(a, m0, group, asked, out); break;
          case 2: group_product<Type, 2>(a, m0, group, asked, out); break;
          case 3: group_product<Type, 3>(a, m0, group, asked, out); break;
          default: group_product<Type, 4>(a, m0, group, asked, out); break;
        }
        for (int i = 0; i < rows; ++i)
          for (int r = 0; r < kRows; ++r)
            y[(m0 + i) * N + g * kRows + r] = out[i][r] + (bias ? bias[g * kRows + r] : 0.f);
      }
    }
  });
}
#endif  // PAGEDRL_INT8_KROWS8

}  // namespace gguf_int8_krows8
