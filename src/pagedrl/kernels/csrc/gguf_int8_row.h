// One input row against GGUF weights in integer dot products, two weight blocks a step (AVX512-VNNI):
// a single stream's decode step (`gguf_int8_dot.cpp`'s `sequential_rows`).
//
// Why: one block a step in 256-bit vectors cost about 7 cycles a block even from L2 (2.1 ns for 34
// bytes, 16 GB/s: below the memory's one-thread 21-26), most of it per-block work around the one dot
// product (|w| and sign(x, w), the scale's half widened, multiplied and broadcast). Here two blocks fill
// one 512-bit vector, the weight bytes are made unsigned with one xor (Q8_0: w + 128; the nibbles already
// are), the offset that makes (k = 128, or Q4_0's 8) comes in as the dot product's starting sums,
// prepared once per input row, and both blocks' scales are widened and multiplied in one step.
//
// Exactness as in `gguf_int8_groups.h`: each lane's starting sum -k * (its 4 q) plus 4 products of an
// unsigned byte and |q| <= 127 is an exact int32.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDRL_INT8_ROW_PAIRS 1

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <memory>

#include "gguf_int8_groups.h"

namespace gguf_int8_row {

// The input row as the pair steps read it, made once per product: per pair of blocks the 64 values (for
// nibble types reordered as [x0 0-15, x1 0-15, x0 16-31, x1 16-31], the order the unpacked nibbles take),
// each lane's starting sum, and the scales ([d0, d1], or Q4_1's [d0, s0, d1, s1]).
struct PairRow {
  int64_t pairs;
  const int8_t* q;
  const float* scales;
  std::unique_ptr<int8_t[]> reordered;
  std::unique_ptr<int32_t[]> start;
  std::unique_ptr<float[]> interleaved;

  template <class T>
  PairRow(T, const int8_t* q_row, const float* d, const float* s, int64_t blocks)
      : pairs(T::kPairs ? blocks / 2 : 0), q(q_row), scales(d), start(new int32_t[pairs * 16]()) {
    if (!T::kPairs) return;  // its blocks go one at a time
    constexpr bool nibbles = T::kBytes != 34;
    if (nibbles) {
      reordered.reset(new int8_t[pairs * 64]);
      for (int64_t p = 0; p < pairs; ++p)
        for (int half = 0; half < 2; ++half)
          for (int block = 0; block < 2; ++block)
            std::memcpy(reordered.get() + p * 64 + half * 32 + block * 16, q_row + (2 * p + block) * 32 + half * 16,
                        16);
      q = reordered.get();
    }
    if (T::kOffset != 0)
      for (int64_t l = 0; l < pairs * 16; ++l)
        start[l] = -T::kOffset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    if (T::kMinimum) {
      interleaved.reset(new float[pairs * 4]);
      for (int64_t b = 0; b < 2 * pairs; ++b) {
        interleaved[2 * b] = d[b];
        interleaved[2 * b + 1] = s[b];
      }
      scales = interleaved.get();
    }
  }
};

inline uint32_t bits16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t bits32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The dot product of the prepared row with one weight row of `T` (a `gguf_int8_groups` strip type) over
// its first 2 * pairs blocks: the float sum of the blocks' terms and, separately, Q4_1's minimum terms.
// `ahead`: where to ask for the bytes that follow, a pair's worth a step (see `sequential_rows`).
template <class T>
inline void pair_dot(const PairRow& a, const uint8_t* row, const uint8_t* ahead, float* sum, float* minimum) {
  constexpr bool nibbles = T::kBytes != 34;
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();  // the even pairs' sums and the odd ones'
  __m128 mins = _mm_setzero_ps();
  // scale lanes: Q8_0 lanes 0-7 block 0, 8-15 block 1; nibbles lanes 0-3 and 8-11 block 0, the rest block 1;
  // Q4_1's scales sit at 0 and 2 of [d0 dw0, s0 mw0, d1 dw1, s1 mw1]
  constexpr int second = T::kMinimum ? 2 : 1;
  const __m512i spread = nibbles ? _mm512_set_epi32(second, second, second, second, 0, 0, 0, 0, second, second,
                                                     second, second, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  auto step = [&](int64_t p, __m512& acc) {
    const uint8_t* b0 = row + 2 * p * T::kBytes;
    const uint8_t* b1 = b0 + T::kBytes;
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * p * T::kBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * p * T::kBytes + T::kBytes), _MM_HINT_T0);
    }
    __m512i u;
    __m128 scale;
    if constexpr (!nibbles) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2));
      u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), _mm512_set1_epi8(-128));
      const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits16(b0) | bits16(b1) << 16)));
      scale = _mm_mul_ps(dw, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.scales + 2 * p))));
    } else {
      constexpr int head = T::kMinimum ? 4 : 2;
      const __m256i t = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + head))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + head)), 1);
      const __m256i low = _mm256_set1_epi8(15);
      u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(t, low)),
                             _mm256_and_si256(_mm256_srli_epi16(t, 4), low), 1);
      if constexpr (T::kMinimum) {  // [dw0, mw0, dw1, mw1] times [d0, s0, d1, s1]
        const __m128i h = _mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(bits32(b0))),
                                           static_cast<int>(bits32(b1)), 1);
        scale = _mm_mul_ps(_mm_cvtph_ps(h), _mm_loadu_ps(a.scales + 4 * p));
        mins = _mm_add_ps(mins, scale);
      } else {
        const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits16(b0) | bits16(b1) << 16)));
        scale = _mm_mul_ps(dw, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.scales + 2 * p))));
      }
    }
    // (types with no offset start from zeros: one 512-bit load fewer a step; two rows at once sharing the
    // loads ran as fast from L2 but read memory as two streams, 30-50% slower)
    const __m512i start = T::kOffset != 0 ? _mm512_loadu_si512(a.start.get() + 16 * p) : _mm512_setzero_si512();
    const __m512i sums = _mm512_dpbusd_epi32(start, u, _mm512_loadu_si512(a.q + 64 * p));
    const __m512 lanes = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale));
    acc = _mm512_fmadd_ps(lanes, _mm512_cvtepi32_ps(sums), acc);
  };
  // Two pairs a turn, so that both sums stay in registers (`sequential_rows` says why).
  int64_t p = 0;
  for (; p + 1 < a.pairs; p += 2) {
    step(p, even);
    step(p + 1, odd);
  }
  if (p < a.pairs) step(p, even);
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  float m[4];
  _mm_storeu_ps(m, mins);
  *minimum = m[1] + m[3];
}

}  // namespace gguf_int8_row

#endif
