// Many rows against GGUF weights in integer dot products (`gguf_int8_dot.cpp`'s prefill chunks and batched
// decode steps): rows in groups of one vector's lanes (16 with AVX512-VNNI, 8 otherwise), each lane one
// row's sum, against a strip of weight rows unpacked once to unsigned bytes.
//
// Why: a 128-token prefill of the default model's Q8_0 projections took 390 ms of a 1.16 s single stream
// when groups were 8 rows against one weight row: one chain of dot products per block (each waits for the
// last), and the weights' sum recomputed for every group. Here 4 weight rows run 4 independent chains, a
// lane vector holds 16 rows, and the weight bytes are made unsigned once per strip (Q8_0: w + 128, with
// 128 * sum(q) taken off through the activation block's integer sum; Q4_0 / Q4_1: their nibbles as they
// are, Q4_0's -8 likewise): per block and 4 x 16 row pairs, 32 dot products of 64 products each and a
// handful of float operations. llama.cpp repacks its weights at load for the same reason; the strip is
// made on the fly, so one layout serves the one-row product (address order) and this one.
//
// The sums are exact integers (unsigned bytes <= 255 times |q| <= 127, 32 to a block); AVX2 without VNNI
// pairs bytes in 16 bits with saturation, so there only the nibbles (<= 15) go through `vpmaddubsw`, and
// Q8_0's signed weights are kept as 16-bit pairs against the rows' bytes widened in registers (`vpmaddwd`
// alone: two products a lane, no saturation). The same integers, so the same outputs, on every path.
// (The earlier AVX2 form, |w| times q signed by w, spent a third multiplier-port instruction per 32
// products on the signs: a 2048 x 576 x 1536 product 31-33 ms against 20 ms without that instruction.)
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf_int8_groups {

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
constexpr bool kUnsignedBytes = true;  // an unsigned operand up to 255 sums without saturation
#else
constexpr bool kUnsignedBytes = false;
#endif
// Weight rows a strip holds, each an independent chain of dot products (16 lanes: 8 sums and 8 float sums
// in registers; 8 lanes on AVX2: 4, of 16 registers).
constexpr int kStripRows = kLanes == 16 ? 8 : 4;

typedef int32_t LaneSums __attribute__((vector_size(4 * kLanes)));
typedef float LaneFloats __attribute__((vector_size(4 * kLanes)));

// acc + in each lane the sum of 4 products: the 4 unsigned bytes of `u4` (the same in every lane) times
// the lane's 4 signed bytes in `x`.
inline LaneSums lane_dot(LaneSums acc, int32_t u4, LaneSums x) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return (LaneSums)_mm512_dpbusd_epi32((__m512i)acc, _mm512_set1_epi32(u4), (__m512i)x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return (LaneSums)_mm256_dpbusd_epi32((__m256i)acc, _mm256_set1_epi32(u4), (__m256i)x);
#elif defined(__AVXVNNI__)
  return (LaneSums)_mm256_dpbusd_avx_epi32((__m256i)acc, _mm256_set1_epi32(u4), (__m256i)x);
#elif defined(__AVX2__)  // pairs into int16 (nibbles: at most 2 * 15 * 127), then pairs of those
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(u4), (__m256i)x);
  return acc + (LaneSums)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  LaneSums out = acc;
  uint8_t u[4];
  int8_t s[4 * kLanes];
  std::memcpy(u, &u4, 4);
  std::memcpy(s, &x, sizeof(s));
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) out[l] += static_cast<int32_t>(u[i]) * static_cast<int32_t>(s[4 * l + i]);
  return out;
#endif
}

// The lanes' 4 signed bytes as two vectors of 16-bit pairs: values 0 and 2 of each lane, values 1 and 3.
struct ShortPairs {
  LaneSums even, odd;
};

inline ShortPairs short_pairs(LaneSums x) {
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))  // 8 lanes
  return {(LaneSums)_mm256_srai_epi16(_mm256_slli_epi16((__m256i)x, 8), 8), (LaneSums)_mm256_srai_epi16((__m256i)x, 8)};
#else
  ShortPairs out;
  int8_t s[4 * kLanes];
  std::memcpy(s, &x, sizeof(s));
  int16_t even[2 * kLanes], odd[2 * kLanes];
  for (int i = 0; i < 2 * kLanes; ++i) {
    even[i] = s[2 * i];
    odd[i] = s[2 * i + 1];
  }
  std::memcpy(&out.even, even, sizeof(even));
  std::memcpy(&out.odd, odd, sizeof(odd));
  return out;
#endif
}

// acc + in each lane the sum of 4 products of signed values: the weight's (the same in every lane), as the
// 16-bit pairs `even4` (values 0 and 2) and `odd4` (1 and 3), and the lane's, as `short_pairs` gives them.
inline LaneSums lane_dot_pairs(LaneSums acc, int32_t even4, int32_t odd4, const ShortPairs& x) {
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))  // 8 lanes
  __m256i sums = _mm256_add_epi32((__m256i)acc, _mm256_madd_epi16((__m256i)x.even, _mm256_set1_epi32(even4)));
  sums = _mm256_add_epi32(sums, _mm256_madd_epi16((__m256i)x.odd, _mm256_set1_epi32(odd4)));
  __asm__("" : "+x"(sums));  // summed in this order: reassociated into a tree, the products spill
  return (LaneSums)sums;
#else
  LaneSums out = acc;
  int16_t w[4], xe[2 * kLanes], xo[2 * kLanes];
  std::memcpy(w, &even4, 4);
  std::memcpy(w + 2, &odd4, 4);
  std::memcpy(xe, &x.even, sizeof(xe));
  std::memcpy(xo, &x.odd, sizeof(xo));
  for (int l = 0; l < kLanes; ++l)
    out[l] += w[0] * xe[2 * l] + w[1] * xe[2 * l + 1] + w[2] * xo[2 * l] + w[3] * xo[2 * l + 1];
  return out;
#endif
}

template <class V>
inline V load_lanes(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The first `count` rows of the activation blocks interleaved kLanes rows to a group (rows past the end are
// zeros: d = s = 0, no term): per group and block, the 32 values as 8 vectors of the lanes' 4
// consecutive values, then the lanes' d, s and integer sum of q side by side.
struct RowGroups {
  int64_t groups, blocks;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, s;
  std::unique_ptr<int32_t[]> total;

  RowGroups(const int8_t* q_rows, const float* d_rows, const float* s_rows, const int32_t* totals, int64_t count,
            int64_t blocks_)
      : groups((count + kLanes - 1) / kLanes), blocks(blocks_),
        q(new int8_t[groups * blocks_ * 32 * kLanes]()), d(new float[groups * blocks_ * kLanes]()),
        s(new float[groups * blocks_ * kLanes]()), total(new int32_t[groups * blocks_ * kLanes]()) {
    for (int64_t r = 0; r < count; ++r) {
      const int64_t g = r / kLanes, lane = r % kLanes, row = r;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = (g * blocks + b) * kLanes + lane, from = row * blocks + b;
        d[at] = d_rows[from];
        s[at] = s_rows[from];
        total[at] = totals[from];
        int8_t* to = q.get() + (g * blocks + b) * 32 * kLanes + 4 * lane;
        for (int v = 0; v < 8; ++v) std::memcpy(to + v * 4 * kLanes, q_rows + from * 32 + 4 * v, 4);  // 4 values a step
      }
    }
  }
};

inline float half_value(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

inline void unpack_nibbles(const uint8_t* q, uint8_t* u) {  // value i: nibble i / 16 of byte i % 16
#if defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), low = _mm_set1_epi8(15);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm_and_si128(b, low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16), _mm_and_si128(_mm_srli_epi16(b, 4), low));
#else
  for (int i = 0; i < 16; ++i) {
    u[i] = q[i] & 15;
    u[i + 16] = q[i] >> 4;
  }
#endif
}

// Q5_0 / Q5_1's 32 values 0..31: the nibbles (as `unpack_nibbles`) with bit i of the 32-bit `qh` as value
// i's fifth bit.
inline void unpack_five_bits(const uint8_t* qh, const uint8_t* qs, uint8_t* u) {
  uint32_t high;
  std::memcpy(&high, qh, 4);
#if defined(__AVX2__)  // each byte its bit of `high`: spread the 4 bytes, set all other bits, compare to all-ones
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(high)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low = _mm_set1_epi8(15);
  const __m256i n = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_or_si256(n, _mm256_and_si256(set, _mm256_set1_epi8(16))));
#else
  unpack_nibbles(qs, u);
  for (int i = 0; i < 32; ++i) u[i] |= static_cast<uint8_t>(((high >> i) & 1) << 4);
#endif
}

// What a weight type gives the strip: its 32 values as unsigned bytes u, the scale, the minimum (Q4_1,
// Q5_1), and the integer k with value = dw * (u - k) (+ mw): sum(value q) = dw * (sum(u q) - k sum(q))
// (+ mw s). `kPairs`: the one-row product takes it two blocks a step (`gguf_int8_row.h`); `kRows8`: it
// can be kept in the `rows8` layout (`gguf_int8_rows8.h`).
// Q8_0 with an unsigned operand up to 255 (VNNI): u = w + 128, k = 128. Without (`kShortPairs`): each 4
// values' 16-bit pairs, values 0 and 2 in u, 1 and 3 in `odd`, k = 0.
struct StripQ8_0 {
  static constexpr int kBytes = 34, kOffset = kUnsignedBytes ? 128 : 0;
  static constexpr bool kMinimum = false, kShortPairs = !kUnsignedBytes, kPairs = true, kRows8 = false;
  static void unpack(const uint8_t* block, uint8_t* u, uint8_t* odd, float* dw, float*) {
    *dw = half_value(block);
#if defined(__AVX2__)
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    if (kShortPairs) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(odd), _mm256_srai_epi16(w, 8));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_xor_si256(w, _mm256_set1_epi8(-128)));
    }
#else
    if (kShortPairs) {
      int16_t even[16], odd16[16];
      for (int i = 0; i < 16; ++i) {
        even[i] = static_cast<int8_t>(block[2 + 2 * i]);
        odd16[i] = static_cast<int8_t>(block[3 + 2 * i]);
      }
      std::memcpy(u, even, 32);
      std::memcpy(odd, odd16, 32);
    } else {
      for (int i = 0; i < 32; ++i) u[i] = static_cast<uint8_t>(block[2 + i] ^ 0x80);
    }
#endif
  }
};
struct StripQ4_0 {
  static constexpr int kBytes = 18, kOffset = 8;
  static constexpr bool kMinimum = false, kShortPairs = false, kPairs = true, kRows8 = true;
  static void unpack(const uint8_t* block, uint8_t* u, uint8_t*, float* dw, float*) {
    *dw = half_value(block);
    unpack_nibbles(block + 2, u);
  }
};
struct StripQ4_1 {
  static constexpr int kBytes = 20, kOffset = 0;
  static constexpr bool kMinimum = true, kShortPairs = false, kPairs = true, kRows8 = true;
  static void unpack(const uint8_t* block, uint8_t* u, uint8_t*, float* dw, float* mw) {
    *dw = half_value(block);
    *mw = half_value(block + 2);
    unpack_nibbles(block + 4, u);
  }
};

struct StripQ5_0 {
  static constexpr int kBytes = 22, kOffset = 16;
  static constexpr bool kMinimum = false, kShortPairs = false, kPairs = false, kRows8 = true;
  static void unpack(const uint8_t* block, uint8_t* u, uint8_t*, float* dw, float*) {
    *dw = half_value(block);
    unpack_five_bits(block + 2, block + 6, u);
  }
};
struct StripQ5_1 {
  static constexpr int kBytes = 24, kOffset = 0;
  static constexpr bool kMinimum = true, kShortPairs = false, kPairs = false, kRows8 = true;
  static void unpack(const uint8_t* block, uint8_t* u, uint8_t*, float* dw, float* mw) {
    *dw = half_value(block);
    *mw = half_value(block + 2);
    unpack_five_bits(block + 4, block + 8, u);
  }
};

// kStripRows weight rows' blocks unpacked, block-major: u (and `odd`) [blocks][kStripRows][32], dw and mw
// [blocks][kStripRows], refilled for each strip (rows past a short strip's end hold what they held:
// their sums are not read).
struct Strip {
  int64_t blocks;
  std::unique_ptr<uint8_t[]> u, odd;
  std::unique_ptr<float[]> dw, mw;

  explicit Strip(int64_t blocks_)
      : blocks(blocks_), u(new uint8_t[blocks_ * kStripRows * 32]()), odd(new uint8_t[blocks_ * kStripRows * 32]()),
        dw(new float[blocks_ * kStripRows]()), mw(new float[blocks_ * kStripRows]()) {}

  template <class T>
  void fill(const uint8_t* first_row, int64_t ldw, int rows) {
    for (int j = 0; j < rows; ++j)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = b * kStripRows + j;
        T::unpack(first_row + j * ldw + b * T::kBytes, u.get() + at * 32, odd.get() + at * 32, dw.get() + at,
                  mw.get() + at);
      }
  }
};

// Group g's rows against the strip's rows: out[j][lane] = row (g * kLanes + lane) . weight row j.
template <class T>
inline void group_strip(const RowGroups& a, const Strip& st, int64_t g, LaneFloats out[kStripRows]) {
  LaneFloats acc[kStripRows] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t at = (g * a.blocks + b) * kLanes;
    const int8_t* x = a.q.get() + at * 32;
    const uint8_t* u = st.u.get() + b * kStripRows * 32;
    const uint8_t* odd = st.odd.get() + b * kStripRows * 32;
    LaneSums base = {};
    if constexpr (T::kOffset != 0) base = base - T::kOffset * load_lanes<LaneSums>(a.total.get() + at);
    LaneSums sums[kStripRows];
    for (int j = 0; j < kStripRows; ++j) sums[j] = base;
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      LaneSums xv = load_lanes<LaneSums>(x + v * 4 * kLanes);
#if defined(__AVX__)  // (a 32- or 64-byte vector fits a register only there)
      __asm__("" : "+v"(xv));  // one load for the strip's rows, not one folded into each product
#endif
      [[maybe_unused]] ShortPairs pairs;
      if constexpr (T::kShortPairs) pairs = short_pairs(xv);
#pragma GCC unroll 8
      for (int j = 0; j < kStripRows; ++j) {
        int32_t u4;
        std::memcpy(&u4, u + j * 32 + 4 * v, 4);
        if constexpr (T::kShortPairs) {
          int32_t odd4;
          std::memcpy(&odd4, odd + j * 32 + 4 * v, 4);
          sums[j] = lane_dot_pairs(sums[j], u4, odd4, pairs);
        } else {
          sums[j] = lane_dot(sums[j], u4, xv);
        }
      }
    }
    const LaneFloats d = load_lanes<LaneFloats>(a.d.get() + at);
    for (int j = 0; j < kStripRows; ++j)
      acc[j] += (d * st.dw[b * kStripRows + j]) * __builtin_convertvector(sums[j], LaneFloats);
    if constexpr (T::kMinimum) {
      const LaneFloats s = load_lanes<LaneFloats>(a.s.get() + at);
      for (int j = 0; j < kStripRows; ++j) acc[j] += s * st.mw[b * kStripRows + j];
    }
  }
  for (int j = 0; j < kStripRows; ++j) out[j] = acc[j];
}

}  // namespace gguf_int8_groups
