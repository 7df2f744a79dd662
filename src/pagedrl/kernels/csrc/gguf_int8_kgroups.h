// Many input rows against K-quant weights on 8-bit activations (`gguf_int8_kquants.h`'s products from
// `kMinGroupRows` rows: prefill chunks, batched decode steps): the rows in groups of one vector's lanes
// (16 with AVX512-VNNI, 8 otherwise), each lane one row's sums, against each weight row decoded once.
//
// Why: the row-by-row product decodes a weight block in registers for 4 input rows and spends a
// `vpmaddubsw`, a `vpmaddwd` and an add on every 32 values of every row; a model whose projections are all
// K-quants ran 0.68x llama.cpp at 64 streams. Here each 4 weight values are broadcast against 4 values of
// every lane's row: with VNNI one `vpdpbusd` per 4 values and lane group, a 16-value group's sum scaled
// by one multiply; with AVX2 the `vpmaddubsw` pairs of a group's 4 steps summed in 16 bits (at most
// 4 * 2 * 31 * 127 for Q4_K / Q5_K; Q6_K two steps at a time) and scaled by one `vpmaddwd`.
//
// The numbers: as `gguf_int8_kquants.h` states them, each block's integer sums exact and whole, then per
// lane dw * dx times si (and dm * dx times so) in a fused multiply-add, blocks in order. The row-by-row
// product sums its float32 terms in 8 lanes instead: both within float32 rounding of the formula, not the
// same bits.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gguf_int8_groups.h"
#include "gguf_int8_kquants.h"
#include "gguf_int8_krows8.h"

namespace gguf_int8_kgroups {

using gguf_int8_groups::kLanes;
using gguf_int8_groups::LaneFloats;
using gguf_int8_groups::LaneSums;
using gguf_int8_k::kGroups;
using gguf_int8_k::kValues;

constexpr int kRuns = kValues / 4;  // a block's runs of 4 values

// The activation rows in lane groups (rows past the last are zeros: d = 0, no term): per group and block,
// each run of 4 values as one int32 a lane, then each lane's d, then per pair of 16-value sums the two
// as int16 halves of one int32 (a `vpmaddwd` operand).
struct SuperGroups {
  int64_t groups, blocks;
  std::unique_ptr<int32_t[]> x, pairs;
  std::unique_ptr<float[]> d;

  explicit SuperGroups(const gguf_int8_k::SuperRows& a)
      : groups((a.M + kLanes - 1) / kLanes), blocks(a.blocks), x(new int32_t[groups * blocks * kRuns * kLanes]()),
        pairs(new int32_t[groups * blocks * (kGroups / 2) * kLanes]()), d(new float[groups * blocks * kLanes]()) {
    for (int64_t m = 0; m < a.M; ++m) {
      const int64_t g = m / kLanes, lane = m % kLanes;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = m * blocks + b, block = g * blocks + b;
        const int8_t* q = a.q.get() + at * kValues;
        for (int r = 0; r < kRuns; ++r) std::memcpy(&x[(block * kRuns + r) * kLanes + lane], q + 4 * r, 4);
        const int16_t* sums = a.sums.get() + at * kGroups;
        for (int j = 0; j < kGroups / 2; ++j) std::memcpy(&pairs[(block * (kGroups / 2) + j) * kLanes + lane], sums + 2 * j, 4);
        d[block * kLanes + lane] = a.d[at];
      }
    }
  }
};

// A weight block as the lane products read it: its runs of 4 unsigned values, a scale per 16 values, the
// offsets of each pair of 16-value groups as two int16 in one int32 (Q6_K: 32 times its scales), d and dm.
struct Decoded {
  uint32_t runs[kRuns];
  int32_t scale[kGroups], offset_pairs[kGroups / 2];
  float dw, dm;
};

template <int Type>
inline void decode_row(const uint8_t* row, int64_t blocks, Decoded* out) {
  constexpr int bytes = gguf_int8_k::block_bytes(Type);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bytes;
    int offset[kGroups];
#if defined(__AVX2__)
    gguf_int8_k::for_chunks<Type>(block, [&](int c, __m256i u, __m256i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].runs + 8 * c), u);
    });
    gguf_int8_k::decode_scales<Type>(block, out[b].scale, offset, &out[b].dw, &out[b].dm);
#else
    uint8_t u[kValues];
    gguf_int8_k::decode<Type>(block, u, out[b].scale, offset, &out[b].dw, &out[b].dm);
    std::memcpy(out[b].runs, u, kValues);
#endif
    for (int j = 0; j < kGroups / 2; ++j) {
      const uint32_t lo = static_cast<uint16_t>(offset[2 * j]), hi = static_cast<uint16_t>(offset[2 * j + 1]);
      out[b].offset_pairs[j] = static_cast<int32_t>(lo | hi << 16);
    }
  }
}

inline LaneFloats splat_floats(float v) {
  LaneFloats out = {};
  return out + v;
}

// Each lane's sum over a block's 16-value group k, for the S weight rows `w` (each X run loaded once for
// them): si[j] += scale_jk times sum(u q), exact.
template <int Type, int S>
inline void group_sums(const Decoded* const* w, int64_t b, const int32_t* x, int k, LaneSums* si) {
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__)) && !defined(__AVXVNNI__)
  // pairs of products in 16 bits: Q4_K / Q5_K's 4 steps summed there (<= 4 * 2 * 31 * 127), Q6_K's 2
  __m256i lo[S], hi[S];
  for (int r = 0; r < 4; ++r) {
    const __m256i X = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (4 * k + r) * kLanes));
    for (int j = 0; j < S; ++j) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(static_cast<int>(w[j][b].runs[4 * k + r])), X);
      __m256i& into = (Type == 14 && r >= 2) ? hi[j] : lo[j];
      into = (r == 0 || (Type == 14 && r == 2)) ? p : _mm256_add_epi16(into, p);
    }
  }
  for (int j = 0; j < S; ++j) {
    const __m256i scale = _mm256_set1_epi16(static_cast<int16_t>(w[j][b].scale[k]));
    __m256i t = _mm256_madd_epi16(lo[j], scale);
    if constexpr (Type == 14) t = _mm256_add_epi32(t, _mm256_madd_epi16(hi[j], scale));
    si[j] += (LaneSums)t;
  }
#else
  LaneSums t[S] = {};
  for (int r = 0; r < 4; ++r) {
    const LaneSums X = gguf_int8_groups::load_lanes<LaneSums>(x + (4 * k + r) * kLanes);
    for (int j = 0; j < S; ++j) t[j] = gguf_int8_groups::lane_dot(t[j], static_cast<int32_t>(w[j][b].runs[4 * k + r]), X);
  }
  for (int j = 0; j < S; ++j) si[j] += t[j] * w[j][b].scale[k];
#endif
}

// Each lane's so: the offsets' pairs against the lane's pairs of 16-value sums.
inline LaneSums offset_sum(const Decoded& w, const int32_t* pairs) {
  LaneSums so = {};
  for (int j = 0; j < kGroups / 2; ++j) {
    const LaneSums p = gguf_int8_groups::load_lanes<LaneSums>(pairs + j * kLanes);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    so += (LaneSums)_mm512_madd_epi16(_mm512_set1_epi32(w.offset_pairs[j]), (__m512i)p);
#elif defined(__AVX2__)
    so += (LaneSums)_mm256_madd_epi16(_mm256_set1_epi32(w.offset_pairs[j]), (__m256i)p);
#else
    const int32_t lo = static_cast<int16_t>(w.offset_pairs[j] & 0xffff), hi = static_cast<int16_t>(w.offset_pairs[j] >> 16);
    so += (p << 16 >> 16) * lo + (p >> 16) * hi;
#endif
  }
  return so;
}

inline LaneFloats fma_lanes(LaneFloats a, LaneFloats b, LaneFloats c) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return (LaneFloats)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (LaneFloats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  for (int l = 0; l < kLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

// All lane groups against weight rows [n0, n0 + S) (decoded: `w`).
template <int Type, int S>
void strip_products(const SuperGroups& groups, int64_t M, const Decoded* const* w, int64_t n0, int64_t N,
                    const float* bias, float* y) {
  for (int64_t g = 0; g < groups.groups; ++g) {
    LaneFloats sum[S] = {}, offsets[S] = {};
    for (int64_t b = 0; b < groups.blocks; ++b) {
      const int64_t block = g * groups.blocks + b;
      const int32_t* x = groups.x.get() + block * kRuns * kLanes;
      LaneSums si[S] = {};
      for (int k = 0; k < kGroups; ++k) group_sums<Type, S>(w, b, x, k, si);
      const LaneFloats dx = gguf_int8_groups::load_lanes<LaneFloats>(groups.d.get() + block * kLanes);
      for (int j = 0; j < S; ++j) {
        const LaneSums so = offset_sum(w[j][b], groups.pairs.get() + block * (kGroups / 2) * kLanes);
        if constexpr (Type == 14) {
          sum[j] = fma_lanes(splat_floats(w[j][b].dw) * dx, __builtin_convertvector(si[j] - so, LaneFloats), sum[j]);
        } else {
          sum[j] = fma_lanes(splat_floats(w[j][b].dw) * dx, __builtin_convertvector(si[j], LaneFloats), sum[j]);
          offsets[j] = fma_lanes(splat_floats(w[j][b].dm) * dx, __builtin_convertvector(so, LaneFloats), offsets[j]);
        }
      }
    }
    const int64_t lanes = std::min<int64_t>(kLanes, M - g * kLanes);
    for (int j = 0; j < S; ++j) {
      const LaneFloats out = sum[j] - offsets[j] + (bias ? bias[n0 + j] : 0.f);
      for (int64_t l = 0; l < lanes; ++l) y[(g * kLanes + l) * N + n0 + j] = out[l];
    }
  }
}

constexpr int kStrip = 4;  // weight rows sharing each activation load

// Weight rows [n0, n0 + count) (count <= kStrip, the first at `w0`) decoded into `decoded`, then against all
// lane groups.
template <int Type>
void strip(const SuperGroups& groups, const gguf_int8_k::SuperRows& a, const uint8_t* w0, int64_t ldw, int64_t n0,
           int64_t count, Decoded* decoded, int64_t N, const float* bias, float* y) {
  const Decoded* rows[kStrip];
  for (int j = 0; j < kStrip; ++j) rows[j] = decoded + j * a.blocks;
  for (int j = 0; j < count; ++j) decode_row<Type>(w0 + j * ldw, a.blocks, decoded + j * a.blocks);
  switch (count) {
    case 4: strip_products<Type, 4>(groups, a.M, rows, n0, N, bias, y); break;
    case 3: strip_products<Type, 3>(groups, a.M, rows, n0, N, bias, y); break;
    case 2: strip_products<Type, 2>(groups, a.M, rows, n0, N, bias, y); break;
    default: strip_products<Type, 1>(groups, a.M, rows, n0, N, bias, y); break;
  }
}

// Every input row against weight rows [0, N) of K-quant `Type`: y [M, N]. `rows8`: the weight in the
// `rows8` layout (`gguf_int8_krows8.h`; a build without AVX2), each group of 8 rows unpacked to the file's
// layout first.
template <int Type>
void group_products(const gguf_int8_k::SuperRows& a, const uint8_t* w, int64_t ldw, int64_t N, const float* bias,
                    float* y, bool rows8) {
  const SuperGroups groups(a);
  if (rows8) {
    constexpr int rows = gguf_int8_krows8::kRows;
    at::parallel_for(0, N / rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<Decoded> decoded(kStrip * a.blocks);
      std::unique_ptr<uint8_t[]> unpacked(new uint8_t[rows * ldw]);
      for (int64_t g = begin; g < end; ++g) {
        gguf_int8_krows8::unpack_group<Type>(w + g * rows * ldw, a.blocks, unpacked.get(), ldw);
        for (int j = 0; j < rows; j += kStrip)
          strip<Type>(groups, a, unpacked.get() + j * ldw, ldw, g * rows + j, kStrip, decoded.data(), N, bias, y);
      }
    });
    return;
  }
  at::parallel_for(0, (N + kStrip - 1) / kStrip, 1, [&](int64_t begin, int64_t end) {
    std::vector<Decoded> decoded(kStrip * a.blocks);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * kStrip;
      strip<Type>(groups, a, w + n0 * ldw, ldw, n0, std::min<int64_t>(kStrip, N - n0), decoded.data(), N, bias, y);
    }
  });
}

// From how many input rows the lane groups run (below: `gguf_int8_kquants.h`'s row-by-row product). One
// thread, 30 1536 x 576 weights, ms, row by row / lane groups: AVX512-VNNI Q4_K 4.3 / 6.8 at 8 rows, ~8.7 /
// 8.2 at 16, 75 / 37-49 at 128; AVX2 (8 lanes, no VNNI) 3.5 at 7 rows / 5.5 at 8, 9.4 at 16, 26.8 at 64
// against ~38 row by row.
constexpr int64_t kMinGroupRows = kLanes == 16 ? 16 : 32;

// The product of a K-quant weight (`type` 12, 13 or 14; `rows8`: Q4_K / Q5_K in that layout) by the path
// its row count takes. A weight in the `rows8` layout takes the group steps at every row count: the lane
// groups' bits, and faster than they are at every row count (one thread, 30 576 x 1536 Q4_K weights, ms,
// group steps / lane groups: AVX512-VNNI 4.0 / 6.4 at 16 rows, 15.2 / 25.1 at 64, 29.5 / 37.1 at 128, 58 /
// 95 at 256; AVX2 6.0 / 8.5 at 16, 45 / 58 at 128, 89 / 115 at 256). `ahead(p)`: where a group step at p asks for bytes.
template <class Ahead>
inline void products(const gguf_int8_k::SuperRows& a, int64_t type, const uint8_t* w, int64_t ldw, int64_t N,
                     const float* bias, float* y, bool rows8, const Ahead& ahead) {
#if defined(PAGEDRL_INT8_KROWS8)
  if (rows8) {
    if (type == 12) gguf_int8_krows8::products<12>(a, w, ldw, N, bias, y, ahead);
    else gguf_int8_krows8::products<13>(a, w, ldw, N, bias, y, ahead);
    return;
  }
#else
  (void)ahead;
#endif
  if (a.M < kMinGroupRows && !rows8) return gguf_int8_k::products(a, type, w, ldw, N, bias, y);
  if (type == 12) group_products<12>(a, w, ldw, N, bias, y, rows8);
  else if (type == 13) group_products<13>(a, w, ldw, N, bias, y, rows8);
  else group_products<14>(a, w, ldw, N, bias, y, rows8);
}

}  // namespace gguf_int8_kgroups
