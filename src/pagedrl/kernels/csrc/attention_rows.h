// One query row's attention over keys and values read through a table, kChunk positions at a time with
// an online softmax (running max and sum, the accumulator rescaled when the max grows), in float32 whatever
// the dtype. The routine of the row kernel (`paged_attention.cpp`), and of the prefill tiles
// (`prefill_tiles.cpp`) for rows too few to tile: both files include it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "attention_f32.h"
#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDRL_BF16_DOT 1
#else
#define PAGEDRL_BF16_DOT 0
#endif

namespace pagedrl_cpu {

// Runs work(thread_state, i) for i in [0, n), each i taken by whichever thread is free next, in order:
// items listed largest first finish together (a static split of rows of 32 to 512 keys leaves one
// thread waiting on the other). make_state() builds a thread's scratch once.
template <typename MakeState, typename Work>
void run_largest_first(int64_t n, MakeState&& make_state, Work&& work) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads())), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t i = next++; i < n; i = next++) work(state, i);
  });
}

// A row of head_dim values as float32: a bf16 is the top half of a float32's bits (a shift the
// compiler vectorizes, where c10::BFloat16's conversion is a call per element).
inline void load_row(const float* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d];
}

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t widened = static_cast<uint32_t>(bits[d]) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));  // not a store through a uint32_t*: no aliasing trap
    dst[d] = value;
  }
}

constexpr int64_t kChunk = 16;  // key positions per online-softmax update, whatever the table's block
static_assert(kChunk == 16, "a chunk's scores are one 16-lane vector (its max, the lane sums)");

#if PAGEDRL_BF16_DOT
// A chunk's scaled scores in bf16: each key row's products with the group's query rows, 32 at a time
// with `vdpbf16ps` (exact products, float32 sums), straight from the cache with no float32 copy of the
// key; the 16 positions' sums then come out as one vector. Positions n..15 score 0 (masked later).
template <int kD>
inline void chunk_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* keys, const int64_t* slots, int64_t n,
                              int64_t token_stride, int64_t groups, float scale, float* scores,
                              const c10::BFloat16* ahead = nullptr, int64_t ahead_n = 0) {
  constexpr int kVec = kD / 32;
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < groups; ++g) {
    __m512bh qv[kVec];
    for (int i = 0; i < kVec; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(q + g * kD + 32 * i);
    __m512 sums[16];
    for (int64_t t = 0; t < kChunk; ++t) {
      if (g == 0 && t < ahead_n) pagedrl_cpu::ask_for_row(ahead + t * token_stride, kD * 2);  // the next chunk's keys
      __m512 acc = _mm512_setzero_ps();
      if (t < n) {
        const c10::BFloat16* k = keys + slots[t] * token_stride;
        for (int i = 0; i < kVec; ++i) acc = _mm512_dpbf16_ps(acc, qv[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
      }
      sums[t] = acc;
    }
    _mm512_storeu_ps(scores + g * kChunk, _mm512_mul_ps(pagedrl_cpu::sum_lanes16(sums), scaled));
  }
}
// A chunk's values into each query head's accumulator, acc[g] += p[g][t] * v[t] in position order (as
// the portable loop adds them): each value row widened to float32 in registers once and added to up
// to four heads' accumulators, all held in registers across the chunk (the heads share every row,
// and their FMA chains run side by side).
template <int kD, int kG>
inline void chunk_values_heads(const c10::BFloat16* values, const int64_t* slots, int64_t n, int64_t token_stride,
                               const float* probs, float* acc, const c10::BFloat16* ahead, int64_t ahead_n) {
  constexpr int kF = kD / 16;
  __m512 a[kG][kF];
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kF; ++i) a[g][i] = _mm512_loadu_ps(acc + g * kD + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    if (t < ahead_n) pagedrl_cpu::ask_for_row(ahead + t * token_stride, kD * 2);  // the next chunk's values
    const c10::BFloat16* v = values + slots[t] * token_stride;
    __m512 row[kF];
    for (int i = 0; i < kF; ++i) row[i] = f32_load(v + 16 * i);
    for (int g = 0; g < kG; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * kChunk + t]);
      for (int i = 0; i < kF; ++i) a[g][i] = _mm512_fmadd_ps(p, row[i], a[g][i]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kF; ++i) _mm512_storeu_ps(acc + g * kD + 16 * i, a[g][i]);
}

template <int kD>
inline void chunk_values_bf16(const c10::BFloat16* values, const int64_t* slots, int64_t n, int64_t token_stride,
                              int64_t groups, const float* probs, float* acc, const c10::BFloat16* ahead = nullptr,
                              int64_t ahead_n = 0) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4, ahead_n = 0)
    chunk_values_heads<kD, 4>(values, slots, n, token_stride, probs + g * kChunk, acc + g * kD, ahead, ahead_n);
  switch (groups - g) {
    case 3: chunk_values_heads<kD, 3>(values, slots, n, token_stride, probs + g * kChunk, acc + g * kD, ahead, ahead_n); break;
    case 2: chunk_values_heads<kD, 2>(values, slots, n, token_stride, probs + g * kChunk, acc + g * kD, ahead, ahead_n); break;
    case 1: chunk_values_heads<kD, 1>(values, slots, n, token_stride, probs + g * kChunk, acc + g * kD, ahead, ahead_n); break;
    default: break;
  }
}
#endif

// A layer's rules for the keys a row sees (all off by default): a sliding window (a query at position p sees
// keys p - window + 1 .. p; 0: every key), a cap on the scaled scores (s becomes cap * tanh(s / cap); 0: none)
// and attention sinks (one logit per query head that joins the softmax's denominator only; nullptr: none).
// The window's keys are the only ones read: the loop starts at the chunk of the window's first position,
// so a windowed row costs O(window) whatever the sequence's length.
// s -> cap * tanh(s / cap) on n scores, in arithmetic the compiler vectorizes: tanh(|x|) = (1 - e) / (1 + e)
// with e = exp(-2|x|) <= 1 (`exp_nonpositive`), the sign put back. A loop of std::tanh stays scalar: with a
// cap, a bf16 prompt's attention through the rows took 3x as long (bench/RESULTS.md).
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv_cap = 1.f / cap;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const float x = s[t] * inv_cap;
    const float e = exp_nonpositive(-2.f * std::fabs(x));
    s[t] = std::copysign(cap * (1.f - e) / (1.f + e), x);
  }
}

// The slots of a tile's chunk [first, first + kChunk) (`prefill_tiles.cpp`): slots[t] where position
// first + t lies (table entries of table_block slots each), -1 for positions past the chunk's n and
// below the window's first key `lo` (read as zeros, never a freed block).
inline void tile_chunk_slots(int64_t first, int64_t n, int64_t lo, const int64_t* table, int64_t table_block,
                             int64_t* slots) {
  const bool chunk_in_one_entry = table_block % kChunk == 0;
  int64_t slot = -1;
  for (int64_t t = 0; t < kChunk; ++t) {
    const int64_t p = first + t;
    if (t < n && p >= lo) {
      slot = chunk_in_one_entry && slot >= 0 ? slot + 1 : table[p / table_block] * table_block + p % table_block;
      slots[t] = slot;
    } else {
      slots[t] = -1;
    }
  }
}

struct RowRules {
  int64_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;  // [num_heads] float32
};

// What `attend_row` writes between calls, allocated once per thread and sized by each call.
struct RowScratch {
  void fit(int64_t heads, int64_t head_dim) {  // a resize to the size held does nothing
    query.resize(heads * head_dim);
    acc.resize(heads * head_dim);
    scores.resize(heads * kChunk);
    running_max.resize(heads);
    running_sum.resize(heads);
    row.resize(head_dim);
  }
  std::vector<float> query, acc, scores, running_max, running_sum, row;
  int64_t slots[kChunk];
};

// Row r (q, out and lse indexed by it) attends with the G query heads of each of the KV heads
// h0 .. h0 + kv_heads - 1 over the first `len` positions of `table` (entry i holds table_block
// consecutive slots). kD: head_dim fixed at compile time (0: read at run time). With it and the chunk
// fixed every inner loop has a constant trip count and vectorizes whole: 4x faster than run-time-sized
// loops. A head's result is the same bit for bit whichever heads it is attended with: each head keeps
// its own running max, sum and accumulator, updated in the same order. Why take several: a slot holds
// every KV head's row side by side, so a row of all the heads reads each block's keys and values as
// one contiguous run (a decode step of 64 rows: 2.0 ms a layer one head at a time, 1.0 all heads).
// T: the query's and output's element; C: the cache's, T's own or, under a float32 query, bf16 (a float32
// engine's bf16 cache, `kv_cache_dtype`: the float32 loops over keys and values widened as read).
template <typename T, int kD, typename C = T>
inline void attend_row(const T* q, const C* kc, const C* vc, const int64_t* table, int64_t r, int64_t h0,
                       int64_t kv_heads, int64_t len, T* out, float* lse, int64_t num_heads, int64_t groups,
                       int64_t head_dim_rt, int64_t token_stride, int64_t table_block, float scale, RowScratch& w,
                       const RowRules& rules = RowRules{}, int64_t next_slot = 0, int64_t next_n = 0) {
  const int64_t head_dim = kD ? kD : head_dim_rt;
  const int64_t heads = kv_heads * groups;  // query heads attended here, h0 * groups onward
  const bool chunk_in_one_entry = table_block % kChunk == 0;
  // Below every score, yet finite: exp(lowest - max) is 0 without an infinity in the arithmetic.
  const float lowest = -std::numeric_limits<float>::max();
  w.fit(heads, head_dim);
  float* query = w.query.data();
  float* acc = w.acc.data();
  float* scores = w.scores.data();
  float* running_max = w.running_max.data();
  float* running_sum = w.running_sum.data();
  float* row = w.row.data();
  int64_t* slots = w.slots;
  const T* q_row = q + (r * num_heads + h0 * groups) * head_dim;
  for (int64_t g = 0; g < heads; ++g) {
    float* qg = query + g * head_dim;
    load_row(q_row + g * head_dim, qg, head_dim);
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
    // A sink is one more column of the softmax with no value: the running max starts at its logit and
    // the running sum at exp(sink - sink) = 1, and the accumulator at 0.
    running_max[g] = rules.sinks ? rules.sinks[h0 * groups + g] : lowest;
    running_sum[g] = rules.sinks ? 1.f : 0.f;
  }
  std::fill(acc, acc + heads * head_dim, 0.f);
  // The bytes of one slot this row reads: its heads' rows, side by side.
  const int64_t run_bytes = kv_heads * head_dim * static_cast<int64_t>(sizeof(C));
  // The first position the row sees; chunks start at multiples of kChunk (the same chunks with or without a
  // window), and the positions of the first chunk below `lo` are masked, never the chunks below it.
  const int64_t lo = rules.window > 0 ? std::max<int64_t>(0, len - rules.window) : 0;
  for (int64_t first = lo / kChunk * kChunk; first < len; first += kChunk) {
    const int64_t n = std::min(kChunk, len - first);  // a partial last chunk: its first n positions
    if (chunk_in_one_entry) {
      const int64_t base = table[first / table_block] * table_block + first % table_block;
      for (int64_t t = 0; t < n; ++t) slots[t] = base + t;
    } else {
      // (A chunk may start in a block below the window, freed and pointing nowhere: its masked positions
      // read the window's first key instead, a slot the row may read.)
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = std::max(first + t, lo);
        slots[t] = table[p / table_block] * table_block + p % table_block;
      }
    }
#if PAGEDRL_BF16_DOT || PAGEDRL_F32_CHUNKS
    // The keys and values of a chunk ahead asked for into L2 while this one computes: a chunk is one
    // block in a scattered table, so the hardware's stream prefetcher starts cold at each.
    // The vector chunks (float32 `attention_f32.h`, bf16 above) ask for the next chunk's rows inside
    // their score and value loops, one row as each row of this chunk is read; the portable loops for
    // two chunks ahead, all at once here. A decode layer of 64 rows of 280-320 keys, 30 layers, ms a
    // layer: float32 as AVX2, one thread, 3.6 all at once two ahead, 2.4 spread one ahead, 2.6 spread two
    // ahead, 2.9 three (two threads 2.0 -> 1.3); bf16 on AVX512-BF16, one thread 1.9 -> 1.2, two threads
    // 1.0 -> 0.76. (Before: no prefetch 1.8-2.9, into L1 1.8-2.2, two threads, bf16.) A row's last chunk
    // asks for the next row's first where the caller passes it (`next_slot`, `next_n`): 2.4 -> 2.3, bf16
    // two threads 0.76 -> 0.67.
    constexpr bool kAsksInLoops = (std::is_same_v<T, float> && kD % kF32Lanes == 0 && kD > 0)
#if PAGEDRL_BF16_DOT
                                  || (std::is_same_v<C, c10::BFloat16> && std::is_same_v<T, C> && kD % 32 == 0 &&
                                      kD > 0)
#endif
        ;
    int64_t ahead_base = 0, ahead_n = 0;  // the next chunk's first slot and positions (the vector chunks)
    if (chunk_in_one_entry && first + kChunk < len) {
      const int64_t next = first + kChunk;
      ahead_base = table[next / table_block] * table_block + next % table_block;
      ahead_n = std::min(kChunk, len - next);
    } else if (first + kChunk >= len) {  // the last chunk: the next row's first, where the caller knows it
      ahead_base = next_slot;
      ahead_n = next_n;
    }
    if (!kAsksInLoops && chunk_in_one_entry && first + 2 * kChunk < len) {
      const int64_t next = first + 2 * kChunk;
      const int64_t base = table[next / table_block] * table_block + next % table_block;
      const int64_t m = std::min(kChunk, len - next);
      for (const C* cache : {kc, vc})
        for (int64_t t = 0; t < m; ++t) {
          const char* run = reinterpret_cast<const char*>(cache + (base + t) * token_stride + h0 * head_dim);
          for (int64_t line = 0; line < run_bytes; line += 64) _mm_prefetch(run + line, _MM_HINT_T1);
        }
    }
#endif
    for (int64_t hh = 0; hh < kv_heads; ++hh) {
      const int64_t h = h0 + hh;
      float* head_scores = scores + hh * groups * kChunk;
#if PAGEDRL_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && kD % 32 == 0 && kD > 0) {
        chunk_scores_bf16<kD>(q_row + hh * groups * head_dim, kc + h * head_dim, slots, n, token_stride, groups,
                              scale, head_scores, kc + ahead_base * token_stride + h * head_dim, ahead_n);
        continue;
      }
#endif
#if PAGEDRL_F32_CHUNKS
      if constexpr (std::is_same_v<T, float> && kD % kF32Lanes == 0 && kD > 0) {
        chunk_scores_f32<kD, C>(query + hh * groups * head_dim, kc + h * head_dim, slots, n, token_stride, groups,
                             head_scores, kc + ahead_base * token_stride + h * head_dim, ahead_n);
        continue;
      }
#endif
      for (int64_t t = 0; t < n; ++t) {
        load_row(kc + slots[t] * token_stride + h * head_dim, row, head_dim);
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = query + (hh * groups + g) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          head_scores[g * kChunk + t] = dot;
        }
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      float* sg = scores + g * kChunk;
      if (rules.softcap > 0.f) soft_cap(sg, n, rules.softcap);
      for (int64_t t = 0; t < lo - first; ++t) sg[t] = lowest;  // below the window: weight 0
      for (int64_t t = n; t < kChunk; ++t) sg[t] = lowest;  // positions past the row: weight 0
#if PAGEDRL_BF16_DOT  // a max is exact whatever its order: one vector's tree, not a chain of 16
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(_mm512_loadu_ps(sg)));
#else
      float new_max = running_max[g];
      for (int64_t t = 0; t < kChunk; ++t) new_max = std::max(new_max, sg[t]);
#endif
      const float rescale = exp_nonpositive(running_max[g] - new_max);
      float chunk_sum = 0.f;
#pragma omp simd reduction(+ : chunk_sum)
      for (int64_t t = 0; t < kChunk; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        chunk_sum += sg[t];
      }
      running_sum[g] = running_sum[g] * rescale + chunk_sum;
      running_max[g] = new_max;
      float* ag = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ag[d] *= rescale;
    }
    for (int64_t hh = 0; hh < kv_heads; ++hh) {
      const int64_t h = h0 + hh;
      const float* head_probs = scores + hh * groups * kChunk;
      float* head_acc = acc + hh * groups * head_dim;
#if PAGEDRL_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && kD % 32 == 0 && kD > 0) {
        chunk_values_bf16<kD>(vc + h * head_dim, slots, n, token_stride, groups, head_probs, head_acc,
                              vc + ahead_base * token_stride + h * head_dim, ahead_n);
        continue;
      }
#endif
#if PAGEDRL_F32_CHUNKS
      if constexpr (std::is_same_v<T, float> && kD % kF32Lanes == 0 && kD > 0) {
        chunk_values_f32<kD, C>(vc + h * head_dim, slots, n, token_stride, groups, head_probs, head_acc,
                             vc + ahead_base * token_stride + h * head_dim, ahead_n);
        continue;
      }
#endif
      for (int64_t t = 0; t < n; ++t) {
        load_row(vc + slots[t] * token_stride + h * head_dim, row, head_dim);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = head_probs[g * kChunk + t];
          float* ag = head_acc + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const int64_t head = h0 * groups + g;
    T* o = out + (r * num_heads + head) * head_dim;
    const float inv = 1.f / running_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d] * inv);
    if (lse) lse[r * num_heads + head] = running_max[g] + std::log(running_sum[g]);
  }
}

}  // namespace pagedrl_cpu
