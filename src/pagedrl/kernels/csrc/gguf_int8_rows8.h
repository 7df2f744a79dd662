// Q4_0 / Q4_1 / Q5_0 / Q5_1 weights interleaved eight rows to a group (the `rows8` layout), multiplied on
// 8-bit activations up to 4 input rows a step: a decode step's products, and on AVX2 every product (`gguf_int8_dot.cpp`'s `group_steps_win`).
//
// Why: in the file's own layout a row's blocks come one after another, each 16 nibble bytes behind its
// halves, so a one-row product gathers each block's bytes, widens its own scale and ends every row in a
// horizontal sum: about 7 cycles for two blocks, 15-18 GB/s from L2 where one thread reads memory at
// 20-26. Eight rows interleaved, as llama.cpp's x86 repacking does, make each block step one aligned run
// of bytes: the 8 rows' scales in one load, their nibbles in 4-byte chunks so that each 32-bit lane of a
// dot product is one row's, and no horizontal sum until the group's end.
//
// The layout: a group (rows 8g .. 8g + 7, 8 * row_bytes bytes, the bytes the 8 rows hold in the file's
// layout) holds per block b, in order, 8 * block bytes: the 8 rows' scales d (halves), the `_1` types' 8
// minimums m, Q5's 8 32-bit words of fifth bits, then the nibbles, for chunk c = 0..3 and row r = 0..7 the
// row's nibble bytes 4c .. 4c + 3 (low nibbles values 4c.., high nibbles values 16 + 4c..).
// `unpack_group` gives the rows back in the file's layout (the many-row products and the portable build
// read that).
//
// The numbers: each row's block sums are exact integers (values <= 31 times |q| <= 127; AVX2's 16-bit
// pairs, at most 2 * 31 * 127, are widened every 4 chunk vectors: <= 31496), each scaled (d * dx, then a
// fused multiply-add) and summed in float32 over the blocks in order, the minimum terms apart: the same
// bits with AVX512-VNNI and with AVX2, and a row's sum does not depend on how many input rows share the step.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf_int8_rows8 {

constexpr int kRows = 8;
// Added to a GGML type id by the caller: the weight is in this layout (`ops.GGUF_ROWS8`).
constexpr int64_t kLayoutFlag = 256;
constexpr int kMaxInputRows = 4;  // input rows a step (per row 2 sums in registers, the weights' 4 vectors)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define PAGEDRL_INT8_ROWS8 512
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGEDRL_INT8_ROWS8 256
#endif

template <class S>
constexpr bool fifth_bits() {  // Q5_0 / Q5_1
  return S::kBytes == 22 || S::kBytes == 24;
}

template <class S>
constexpr int head_bytes() {  // the group's halves (and fifth bits) before the nibbles, a block
  return (S::kMinimum ? 32 : 16) + (fifth_bits<S>() ? 32 : 0);
}

// A group's 8 rows in the file's layout: out + r * ldw is row r (the group's `blocks` blocks).
template <class S>
inline void unpack_group(const uint8_t* group, int64_t blocks, uint8_t* out, int64_t ldw) {
  constexpr int halves = S::kMinimum ? 4 : 2, head = halves + (fifth_bits<S>() ? 4 : 0);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* g = group + b * kRows * S::kBytes;
    const uint8_t* chunks = g + head_bytes<S>();
    for (int r = 0; r < kRows; ++r) {
      uint8_t* block = out + r * ldw + b * S::kBytes;
      std::memcpy(block, g + 2 * r, 2);
      if (S::kMinimum) std::memcpy(block + 2, g + 16 + 2 * r, 2);
      if (fifth_bits<S>()) std::memcpy(block + halves, g + 8 * halves + 4 * r, 4);
      for (int c = 0; c < 4; ++c) std::memcpy(block + head + 4 * c, chunks + 32 * c + 4 * r, 4);
    }
  }
}

#if defined(PAGEDRL_INT8_ROWS8)

// The input rows as the group steps read them, made once per product: per row and block 256 bytes, 8
// runs of 32, run (c, half) at 128 * (c / 2) + 64 * half + 32 * (c % 2) holding values 16 * half + 4c ..
// + 3 repeated for the 8 rows' lanes (so that the 512-bit steps read chunks c and c + 1 as one vector).
struct Expanded {
  int64_t rows, blocks;
  std::unique_ptr<int8_t[]> q;

  Expanded(const int8_t* q_rows, int64_t rows_, int64_t blocks_)
      : rows(rows_), blocks(blocks_), q(new int8_t[rows_ * blocks_ * 256]) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* x = q_rows + (m * blocks + b) * 32;
        int8_t* out = q.get() + (m * blocks + b) * 256;
        for (int c = 0; c < 4; ++c)
          for (int half = 0; half < 2; ++half) {
            int32_t four;
            std::memcpy(&four, x + 16 * half + 4 * c, 4);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * (c / 2) + 64 * half + 32 * (c % 2)),
                                _mm256_set1_epi32(four));
          }
      }
  }
  const int8_t* at(int64_t m, int64_t b) const { return q.get() + (m * blocks + b) * 256; }
};

// Each 32-bit lane's low byte in all its 4 bytes (a byte shuffle's indices, per 128 bits).
static const __m128i kLowBytes = _mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);

#if PAGEDRL_INT8_ROWS8 == 512
// `w` (lanes 0-7: values first .. first + 3 of rows 0-7; lanes 8-15: first + 4 .. of the same rows) with
// 16 added where the rows' fifth bits (`high`, a row's 32-bit word in lanes r and r + 8) are set.
inline __m512i with_fifth_bits(__m512i w, __m512i high, int first) {
  const __m512i shifted = _mm512_srlv_epi32(high, _mm512_set_epi32(first + 4, first + 4, first + 4, first + 4,
                                                                     first + 4, first + 4, first + 4, first + 4,
                                                                     first, first, first, first, first, first,
                                                                     first, first));
  const __m512i low_byte = _mm512_shuffle_epi8(shifted, _mm512_broadcast_i32x4(kLowBytes));
  const __mmask64 set = _mm512_test_epi8_mask(low_byte, _mm512_set1_epi32(0x08040201));
  return _mm512_mask_add_epi8(w, set, w, _mm512_set1_epi8(16));
}
#else
// The same for AVX2's one chunk vector (lane r: row r's values first .. first + 3).
inline __m256i with_fifth_bits(__m256i w, __m256i high, int first) {
  const __m256i shifted = _mm256_srli_epi32(high, first);
  const __m256i low_byte = _mm256_shuffle_epi8(shifted, _mm256_broadcastsi128_si256(kLowBytes));
  const __m256i bits = _mm256_set1_epi32(0x08040201);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(low_byte, bits), bits);
  return _mm256_add_epi8(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
#endif

// Input rows m0 .. m0 + MB against one group: out[i][r] = row (m0 + i) . weight row (8g + r), without bias.
// d, s, total: the activation blocks' scales, d * sum(q) and sum(q) ([rows, blocks]). `ahead`: where to
// ask for bytes a step (nullptr: none).
template <class S, int MB>
inline void group_product(const Expanded& a, const float* d, const float* s, const int32_t* total, int64_t m0,
                          const uint8_t* group, const uint8_t* ahead, float out[][kRows]) {
  const int64_t blocks = a.blocks;
  constexpr int64_t step_bytes = kRows * S::kBytes;
  __m256 acc[MB], mins[MB];  // lane r: row r's sum over the blocks so far; its minimum terms
  for (int i = 0; i < MB; ++i) acc[i] = mins[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* g = group + b * step_bytes;
    if (ahead) {
      for (int64_t line = 0; line < step_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * step_bytes + line), _MM_HINT_T0);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (S::kMinimum) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
    const uint8_t* nibbles = g + head_bytes<S>();
#if PAGEDRL_INT8_ROWS8 == 512
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i v0 = _mm512_loadu_si512(nibbles), v1 = _mm512_loadu_si512(nibbles + 64);
    __m512i w0 = _mm512_and_si512(v0, low), w1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
    __m512i w2 = _mm512_and_si512(v1, low), w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
    if constexpr (fifth_bits<S>()) {  // lane l: row l % 8's values from 4 * (l / 8) + the vector's first
      const __m512i high = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + (S::kMinimum ? 32 : 16))));
      w0 = with_fifth_bits(w0, high, 0);
      w1 = with_fifth_bits(w1, high, 16);
      w2 = with_fifth_bits(w2, high, 8);
      w3 = with_fifth_bits(w3, high, 24);
    }
#endif
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * blocks + b;
      const int8_t* x = a.at(m0 + i, b);
#if PAGEDRL_INT8_ROWS8 == 512
      // lanes 0-7 rows 0-7 over chunks 0 and 2, lanes 8-15 the same rows over chunks 1 and 3
      __m512i sums = S::kOffset != 0 ? _mm512_maskz_set1_epi32(0xff, -S::kOffset * total[at]) : _mm512_setzero_si512();
      sums = _mm512_dpbusd_epi32(sums, w0, _mm512_loadu_si512(x));
      sums = _mm512_dpbusd_epi32(sums, w1, _mm512_loadu_si512(x + 64));
      sums = _mm512_dpbusd_epi32(sums, w2, _mm512_loadu_si512(x + 128));
      sums = _mm512_dpbusd_epi32(sums, w3, _mm512_loadu_si512(x + 192));
      // the block's exact integer sum per row, as AVX2 has it: so both give the same bits
      const __m256i block = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
#else
      const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
      __m256i pairs = _mm256_setzero_si256(), sums = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 32 * c));
        const int8_t* run = x + 128 * (c / 2) + 32 * (c % 2);
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (fifth_bits<S>()) {
          const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + (S::kMinimum ? 32 : 16)));
          lo = with_fifth_bits(lo, high, 4 * c);
          hi = with_fifth_bits(hi, high, 16 + 4 * c);
        }
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run))));
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 64))));
        if (c % 2 == 1) {  // widened every 4 vectors: at most 4 * 2 * 31 * 127 in 16 bits
          sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
          pairs = _mm256_setzero_si256();
        }
      }
      if constexpr (S::kOffset != 0) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(S::kOffset * total[at]));
      const __m256i block = sums;
#endif
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(d[at])), _mm256_cvtepi32_ps(block), acc[i]);
      if constexpr (S::kMinimum) mins[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[at]), mins[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm256_storeu_ps(out[i], _mm256_add_ps(acc[i], mins[i]));
}

#endif  // PAGEDRL_INT8_ROWS8

}  // namespace gguf_int8_rows8
