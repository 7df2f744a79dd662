// A prefill's attention in tiles for a float32 cache (AVX2 with FMA, or AVX512F): the tiles of
// `prefill_tiles.cpp` in float32 fused multiply-adds, for CPUs without the bf16 dot products and for
// float32 engines everywhere.
//
// Why: the row kernel (`attention_rows.h`) reads every key once per query row, a dot product a head
// with a sum across a vector's lanes at the end; a prompt's rows share their keys. A tile lays its 3
// vectors of query heads out once ([D][24] with 8 lanes, [D][48] with 16: G query heads of 24 / G or
// 48 / G consecutive rows), so a key's value at d, broadcast, gives that key's partial scores for a
// vector of heads in one multiply-add, with no lane sums (the register tile of a GEMM: 4 keys x 3
// vectors of sums with 8 lanes' 16 registers, 8 x 3 with 16 lanes' 32); the online softmax runs down
// the chunk's 16 keys for all heads at once, and the values go into 6 heads' slices of 2 vectors (8
// lanes) or 4 (16), each value row read once for them. Each score is a chain of multiply-adds over d in
// order, each output a chain over the positions in order: the same bits whichever rows or sequences
// share the call, as the row kernel's are, though not the row kernel's own bits (its scores add across
// lanes). One layer of 64 prompts of 32-512 tokens, two threads: 70 ms against the row kernel's 106 as
// AVX2, 66 against 102 on AVX512 (`bench/RESULTS.md`). A float32 engine's bf16 cache (`kv_cache_dtype`)
// takes the same tiles: each chunk's 16 key and value rows widened to float32 into the thread's scratch
// once (C: the cache's element), then the float32 loops over them. (Widening each key's value as it was
// broadcast, a load, a shift and a broadcast in the innermost loop, took one layer of 64 prompts from 66
// to 89-99 ms, two threads, as AVX2.)
#pragma once

#include "attention_rows.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#if PAGEDRL_F32_CHUNKS
namespace pagedrl_cpu {

constexpr int kF32HeadVectors = 3;
constexpr int kF32TileHeads = kF32Lanes * kF32HeadVectors;  // 24 with AVX2, 48 with AVX512
// Keys whose sums sit in registers at once: 8 x 3 vectors of 32 registers with 16 lanes, 4 x 3 of 16 with
// 8 (the 3 query vectors and a key's broadcast take the other 4: 7 loads to 12 multiply-adds). The query
// vectors are pinned to registers (`f32_key_block_scores`): GCC folded them into each multiply-add as a
// memory operand, 16 loads to 12, and the loop ran at the loads' pace (1.5 multiply-adds a cycle; one
// layer of 64 prompts as AVX2, one thread, 153 -> 139 ms).
constexpr int kF32KeyBlock = kF32Lanes == 16 ? 8 : 4;
constexpr int kF32ValueHeads = 6;                          // heads whose value slices sit in registers

// Vectors of a head's row in one value slice: 6 heads of 4 (24 accumulators of 32 registers) with 16
// lanes, of 2 with 8 (12 of 16: 3 heads of 4 left one accumulator to the stack, a store and a load in
// every position's chain); fewer for head sizes whose row is not a multiple of that.
template <int kD>
constexpr int kF32ValueVectors = kF32Lanes == 16 && (kD / kF32Lanes) % 4 == 0   ? 4
                                 : kF32Lanes == 16 && (kD / kF32Lanes) % 3 == 0 ? 3
                                 : (kD / kF32Lanes) % 2 == 0                    ? 2
                                                                                : 1;

// A thread's buffers. Lane m of a tile is query head m % G of row m / G; lanes past the tile's heads
// hold a zero query that sees no key.
template <int kD>
struct F32TileScratch {
  alignas(64) float query[kD * kF32TileHeads];     // [D][M]: every head's query, scaled
  alignas(64) float probs[kChunk * kF32TileHeads];  // [16 keys][M heads]: scores, then probabilities
  alignas(64) float acc[kF32TileHeads * kD];        // per head: the weighted sum of values so far
  alignas(64) float running_max[kF32TileHeads], running_sum[kF32TileHeads], rescale[kF32TileHeads];
  alignas(64) int32_t position[kF32TileHeads];      // per lane: its row's position (-1: padding)
  alignas(64) int32_t first_key[kF32TileHeads];     // per lane: the first key its row sees (a window)
  alignas(64) float zeros[kD] = {};
  alignas(64) float key_rows[kChunk * kD], value_rows[kChunk * kD];  // a bf16 cache's chunk, widened
};

// Which lanes of a vector of heads see a key: those whose row is at or after it and whose window (first
// key) reaches it.
#if defined(__AVX512F__)
struct SeenLanes {
  SeenLanes(const int32_t* position, const int32_t* first_key)
      : position(_mm512_load_si512(position)), first_key(_mm512_load_si512(first_key)) {}
  __mmask16 lanes(int32_t key) const {
    const __m512i k = _mm512_set1_epi32(key);
    return _mm512_cmp_epi32_mask(k, position, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(k, first_key, _MM_CMPINT_NLT);
  }
  F32Vec max(int32_t key, F32Vec acc, F32Vec x) const { return _mm512_mask_max_ps(acc, lanes(key), acc, x); }
  F32Vec only(int32_t key, F32Vec x) const { return _mm512_maskz_mov_ps(lanes(key), x); }
  __m512i position, first_key;
};
#else
struct SeenLanes {
  SeenLanes(const int32_t* position, const int32_t* first_key)
      : position(_mm256_load_si256(reinterpret_cast<const __m256i*>(position))),
        first_key(_mm256_load_si256(reinterpret_cast<const __m256i*>(first_key))) {}
  __m256 hidden(int32_t key) const {  // all ones where the lane does not see the key
    const __m256i k = _mm256_set1_epi32(key);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(k, position), _mm256_cmpgt_epi32(first_key, k)));
  }
  F32Vec max(int32_t key, F32Vec acc, F32Vec x) const { return _mm256_blendv_ps(_mm256_max_ps(acc, x), acc, hidden(key)); }
  F32Vec only(int32_t key, F32Vec x) const { return _mm256_andnot_ps(hidden(key), x); }
  __m256i position, first_key;
};
#endif

// Scores of keys [t0, t0 + kKeys) against the tile's heads: key t's come out as 3 vectors over the
// heads, a multiply-add for each d of the key's value broadcast against that d's query vectors.
template <int kD, int kKeys>
inline void f32_key_block_scores(F32TileScratch<kD>& w, const float* const* keys, int t0) {
  F32Vec acc[kKeys][kF32HeadVectors];
  for (int t = 0; t < kKeys; ++t)
    for (int v = 0; v < kF32HeadVectors; ++v) acc[t][v] = f32_zero();
  for (int d = 0; d < kD; ++d) {
    F32Vec query[kF32HeadVectors];
    for (int v = 0; v < kF32HeadVectors; ++v) {
      query[v] = f32_load(w.query + d * kF32TileHeads + kF32Lanes * v);
      __asm__("" : "+x"(query[v]));  // in a register: GCC would read it again with each key's multiply-add
    }
    for (int t = 0; t < kKeys; ++t) {
      const F32Vec key = f32_splat(keys[t0 + t][d]);
      for (int v = 0; v < kF32HeadVectors; ++v) acc[t][v] = f32_fma(key, query[v], acc[t][v]);
    }
  }
  for (int t = 0; t < kKeys; ++t)
    for (int v = 0; v < kF32HeadVectors; ++v) f32_store(w.probs + (t0 + t) * kF32TileHeads + kF32Lanes * v, acc[t][v]);
}

// acc[m] = acc[m] * rescale[m] + sum_t p[t][m] * v[t] over the chunk's n positions in order, for heads
// [m0, m0 + kF32ValueHeads), a slice of kF32ValueVectors vectors of their rows at a time.
template <int kD>
inline void f32_block_values(F32TileScratch<kD>& w, const float* const* values, int64_t n, int64_t m0) {
  constexpr int kVV = kF32ValueVectors<kD>;
  for (int d0 = 0; d0 < kD; d0 += kVV * kF32Lanes) {
    F32Vec acc[kF32ValueHeads][kVV];
    for (int b = 0; b < kF32ValueHeads; ++b) {
      const F32Vec r = f32_splat(w.rescale[m0 + b]);
      for (int i = 0; i < kVV; ++i) acc[b][i] = f32_mul(f32_load(w.acc + (m0 + b) * kD + d0 + kF32Lanes * i), r);
    }
    for (int64_t t = 0; t < n; ++t) {
      F32Vec v[kVV];
      for (int i = 0; i < kVV; ++i) v[i] = f32_load(values[t] + d0 + kF32Lanes * i);
      for (int b = 0; b < kF32ValueHeads; ++b) {
        const F32Vec p = f32_splat(w.probs[t * kF32TileHeads + m0 + b]);
        for (int i = 0; i < kVV; ++i) acc[b][i] = f32_fma(p, v[i], acc[b][i]);
      }
    }
    for (int b = 0; b < kF32ValueHeads; ++b)
      for (int i = 0; i < kVV; ++i) f32_store(w.acc + (m0 + b) * kD + d0 + kF32Lanes * i, acc[b][i]);
  }
}

// query[m][d] * scale into out[d][m] for the tile's kM heads, 8 x 8 blocks transposed in registers (a
// value at a time, the strided stores were 8% of a tile's time).
template <int kD>
inline void transpose_queries(const float* const* query, float scale, float* out) {
  const __m256 scaled = _mm256_set1_ps(scale);
  for (int m0 = 0; m0 < kF32TileHeads; m0 += 8)
    for (int d0 = 0; d0 < kD; d0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(query[m0 + i] + d0), scaled);
      for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved, then quadruples, then the halves
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out + (d0 + i) * kF32TileHeads + m0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(out + (d0 + i + 4) * kF32TileHeads + m0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
}

// Rows first_row .. first_row + rows - 1 of the step (positions first_pos ..), query heads of KV head
// `head`, over the keys of their sequence's `table`. A layer's rules (`RowRules`) as the bf16 tiles
// keep them: the chunks wholly below the first row's window are not read, and the keys of the first
// chunk below it read zeros (never a freed block); a cap on the scores; sinks (a lane's running max
// starts at its head's logit and its running sum at 1).
template <int kD, typename C>
void attend_tile_f32(int64_t first_row, int64_t rows, int64_t first_pos, int64_t head, const float* q,
                     const C* kc, const C* vc, const int64_t* table, float* out, int64_t num_heads,
                     int64_t groups, int64_t token_stride, int64_t table_block, float scale, F32TileScratch<kD>& w,
                     const RowRules& rules) {
  constexpr int kM = kF32TileHeads;
  const float lowest = -std::numeric_limits<float>::max();
  const int64_t h = head, heads = rows * groups;
  const int64_t len = first_pos + rows;  // the tile's last row sees every key before it
  const int64_t lo = rules.window > 0 ? std::max<int64_t>(0, first_pos - rules.window + 1) : 0;
  const float* query[kM];
  for (int64_t m = 0; m < kM; ++m)
    query[m] = m < heads ? q + ((first_row + m / groups) * num_heads + h * groups + m % groups) * kD : w.zeros;
  transpose_queries<kD>(query, scale, w.query);
  for (int64_t m = 0; m < kM; ++m) {
    const bool real = m < heads;
    w.position[m] = real ? static_cast<int32_t>(first_pos + m / groups) : -1;
    w.first_key[m] = rules.window > 0 ? w.position[m] - static_cast<int32_t>(rules.window) + 1
                                      : std::numeric_limits<int32_t>::min();
    w.running_max[m] = rules.sinks && real ? rules.sinks[h * groups + m % groups] : lowest;
    w.running_sum[m] = rules.sinks && real ? 1.f : 0.f;
  }
  std::fill(w.acc, w.acc + kM * kD, 0.f);
  const int64_t value_heads = (heads + kF32ValueHeads - 1) / kF32ValueHeads * kF32ValueHeads;
  const float* keys[kChunk];
  const float* values[kChunk];
  int64_t slots[kChunk];
  for (int64_t first = lo / kChunk * kChunk; first < len; first += kChunk) {
    const int64_t n = std::min(kChunk, len - first);
    tile_chunk_slots(first, n, lo, table, table_block, slots);
    for (int64_t t = 0; t < kChunk; ++t) {
      if (slots[t] < 0) {
        keys[t] = values[t] = w.zeros;
        continue;
      }
      const C* k = kc + slots[t] * token_stride + h * kD;
      const C* v = vc + slots[t] * token_stride + h * kD;
      if constexpr (std::is_same_v<C, float>) {
        keys[t] = k;
        values[t] = v;
      } else {  // bf16 rows widened (exact) into the scratch, once a chunk
        float* key_row = w.key_rows + t * kD;
        float* value_row = w.value_rows + t * kD;
        for (int d = 0; d < kD; d += kF32Lanes) {
          f32_store(key_row + d, f32_load(k + d));
          f32_store(value_row + d, f32_load(v + d));
        }
        keys[t] = key_row;
        values[t] = value_row;
      }
    }
    int t0 = 0;
    for (; t0 + kF32KeyBlock <= n; t0 += kF32KeyBlock) f32_key_block_scores<kD, kF32KeyBlock>(w, keys, t0);
    for (; t0 < n; ++t0) f32_key_block_scores<kD, 1>(w, keys, t0);
    if (rules.softcap > 0.f)
      for (int64_t t = 0; t < n; ++t) soft_cap(w.probs + t * kM, kM, rules.softcap);
    // The online softmax, every head at once: lane m's max over the chunk's keys its row sees, then its
    // probabilities; a key after a lane's row, or below its window, weighs 0.
    for (int v = 0; v < kF32HeadVectors; ++v) {
      const SeenLanes seen(w.position + kF32Lanes * v, w.first_key + kF32Lanes * v);
      F32Vec chunk_max = f32_splat(lowest);
      for (int64_t t = 0; t < n; ++t)
        chunk_max = seen.max(static_cast<int32_t>(first + t), chunk_max, f32_load(w.probs + t * kM + kF32Lanes * v));
      const F32Vec running_max = f32_load(w.running_max + kF32Lanes * v);
      const F32Vec new_max = f32_max(running_max, chunk_max);
      const F32Vec rescale = f32_exp_nonpositive(f32_sub(running_max, new_max));
      F32Vec chunk_sum = f32_zero();
      for (int64_t t = 0; t < n; ++t) {
        float* scores = w.probs + t * kM + kF32Lanes * v;
        const F32Vec p = seen.only(static_cast<int32_t>(first + t), f32_exp_nonpositive(f32_sub(f32_load(scores), new_max)));
        chunk_sum = f32_add(chunk_sum, p);
        f32_store(scores, p);
      }
      f32_store(w.running_sum + kF32Lanes * v, f32_fma(f32_load(w.running_sum + kF32Lanes * v), rescale, chunk_sum));
      f32_store(w.running_max + kF32Lanes * v, new_max);
      f32_store(w.rescale + kF32Lanes * v, rescale);
    }
    for (int64_t m0 = 0; m0 < value_heads; m0 += kF32ValueHeads) f32_block_values<kD>(w, values, n, m0);
  }
  for (int64_t m = 0; m < heads; ++m) {
    float* o = out + ((first_row + m / groups) * num_heads + h * groups + m % groups) * kD;
    const float inv = 1.f / w.running_sum[m];
    for (int d = 0; d < kD; ++d) o[d] = w.acc[m * kD + d] * inv;
  }
}

}  // namespace pagedrl_cpu
#endif
