// A prefill's attention in tiles (CPU, bf16 with AVX512-BF16; float32 in `prefill_tiles_f32.h`): the
// rows of a prompt chunk, read through the block table where the keys and values lie, 48 query heads at a time (16 consecutive positions of
// one sequence with the 3 query heads of one KV head; 48 / G positions for G query heads a KV head).
//
// Why tiles: the row kernel (`attention_rows.h`) reads every key once per query row and sums each score
// across a vector's lanes; a prompt's rows share their keys. A tile lays its queries out once in
// dot-product pairs ([D / 2][48 heads]), so `vdpbf16ps` of a broadcast pair of a key's values gives that
// key's scores for 16 heads in one vector, with no lane sums; the online softmax then runs down the
// chunk's 16 keys for all heads at once (vertical max and sum, no reductions either). The values go in
// two positions a step (`vdpbf16ps` on the probabilities rounded to bf16, as a GPU's flash attention
// multiplies them; running sums and the rescaling stay float32). 64 prompts of 32-512 tokens: 36-42 ms
// a layer against the row kernel's 70-90; float32 FMAs for the values took 50-59 ms; mean error
// against float64 4.1e-4 against the row kernel's 3.3e-4 (both round the output to bf16). The engine's
// prefill does not need a trainer's bits: batch-invariant mode keeps the row kernel.
//
// Tiles of too few query heads (a decode in a mixed step), and every row of a model with more than 48
// query heads a KV head, take the row routine. Tiles are handed out to whichever thread is free, a
// sequence's together and largest first within it: their costs differ by the length of the prefix
// they read, and a sequence's tiles read the same keys.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "attention_rows.h"
#include "prefill_tiles_f32.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using pagedrl_cpu::kChunk;

constexpr int kLanes = 16;                 // float32 lanes of a vector
constexpr int kHeadVectors = 3;            // a tile's query heads: three vectors of 16 lanes
constexpr int kTileHeads = kLanes * kHeadVectors;
constexpr int kKeyBlock = 8;               // keys whose scores sit in registers at once (8 x 3 vectors)
constexpr int64_t kMinTileHeads = 12;      // fewer query heads than this in a tile: the row routine
// Query heads whose accumulators sit in registers at once (D / 16 vectors each, out of 32).
template <int kD>
constexpr int kValueBlock = kD <= 64 ? 6 : kD <= 128 ? 3 : 1;

struct Tile {
  int64_t seq, first_row, rows, first_pos, head;  // rows first_row.. of the step at positions first_pos..
  int64_t cost;                                    // query heads x key positions: the order tiles go in
};

// Rows per tile: as many as fill the tile's 48 query heads (16 for three query heads per KV head).
inline int64_t tile_rows(int64_t groups, int64_t tile_heads) { return std::max<int64_t>(1, tile_heads / groups); }

#if PAGEDRL_BF16_DOT
// A thread's buffers. Lane m of a tile is query head m % G of row m / G; lanes past the tile's heads
// hold a zero query that sees no key.
template <int kD>
struct TileScratch {
  TileScratch() : zeros(kD / 2, 0u) {}
  alignas(64) uint32_t query_pairs[kD / 2 * kTileHeads];  // [D / 2][48]: pair j of every head's query
  alignas(64) uint16_t value_pairs[kChunk * kD];          // [8 pairs][D][2]: positions 2i, 2i + 1 interleaved
  alignas(64) uint32_t prob_pairs[kChunk / 2 * kTileHeads]; // [8 pairs][48 heads]: probabilities in bf16 pairs
  alignas(64) float probs[kChunk * kTileHeads];           // [16 keys][48 heads]: scores, then probabilities
  alignas(64) float acc[kTileHeads * kD];                 // per head: the weighted sum of values so far
  alignas(64) float rescale[kTileHeads], sum[kTileHeads];
  alignas(64) int32_t position[kTileHeads];               // per lane: its row's position (-1: padding)
  std::vector<uint32_t> zeros;
};

// Scores of keys [t0, t0 + kKeyBlock) against the tile's 48 query heads: key t's scores come out as three
// vectors over the heads, accumulated pair by pair from a broadcast pair of the key's values.
template <int kD>
inline void key_block_scores(TileScratch<kD>& w, const uint32_t* const* keys, int t0, float scale) {
  __m512 acc[kKeyBlock][kHeadVectors];
  for (int t = 0; t < kKeyBlock; ++t)
    for (int v = 0; v < kHeadVectors; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int j = 0; j < kD / 2; ++j) {
    __m512bh query[kHeadVectors];
    for (int v = 0; v < kHeadVectors; ++v)
      query[v] = (__m512bh)_mm512_load_si512(w.query_pairs + j * kTileHeads + kLanes * v);
    for (int t = 0; t < kKeyBlock; ++t) {
      const __m512bh key = (__m512bh)_mm512_set1_epi32(static_cast<int>(keys[t0 + t][j]));
      for (int v = 0; v < kHeadVectors; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], key, query[v]);
    }
  }
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int t = 0; t < kKeyBlock; ++t)
    for (int v = 0; v < kHeadVectors; ++v)
      _mm512_store_ps(w.probs + (t0 + t) * kTileHeads + kLanes * v, _mm512_mul_ps(acc[t][v], scaled));
}

// acc[m] = acc[m] * rescale[m] + sum_t p[t][m] * v[t] over the chunk, two positions a step (`vdpbf16ps`
// on bf16 probabilities, as a GPU's flash attention multiplies them), for query heads [m0, m0 + kValueBlock).
template <int kD>
inline void block_values(TileScratch<kD>& w, int64_t m0, int64_t pairs) {
  constexpr int kF = kD / 16, kValues = kValueBlock<kD>;
  __m512 acc[kValues][kF];
  for (int b = 0; b < kValues; ++b) {
    const __m512 r = _mm512_set1_ps(w.rescale[m0 + b]);
    for (int i = 0; i < kF; ++i) acc[b][i] = _mm512_mul_ps(_mm512_load_ps(w.acc + (m0 + b) * kD + 16 * i), r);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh v[kF];
    for (int i = 0; i < kF; ++i) v[i] = (__m512bh)_mm512_load_si512(w.value_pairs + j * 2 * kD + 32 * i);
    for (int b = 0; b < kValues; ++b) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(w.prob_pairs[j * kTileHeads + m0 + b]));
      for (int i = 0; i < kF; ++i) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], p, v[i]);
    }
  }
  for (int b = 0; b < kValues; ++b)
    for (int i = 0; i < kF; ++i) _mm512_store_ps(w.acc + (m0 + b) * kD + 16 * i, acc[b][i]);
}

// Lanes 0-15 of a, lanes 0-15 of b, interleaved: a0 b0 a1 b1 ... (16-bit lanes).
inline __m512i interleave16(__m256i a, __m256i b) {
  static const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

// s -> cap * tanh(s / cap) on 16 scores, tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) <= 1.
inline __m512 soft_cap16(__m512 s, float cap) {
  const __m512 x = _mm512_mul_ps(s, _mm512_set1_ps(1.f / cap));
  const __m512 e = pagedrl_cpu::exp_nonpositive16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 signed_t = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
  return _mm512_mul_ps(signed_t, _mm512_set1_ps(cap));
}

// A layer's rules (`RowRules`) hold here as in the row routine: a window (each lane's row sees its last
// `window` keys; the chunks wholly below the tile's first row's window are not read, and the keys of the
// first chunk that fall below it read zeros, never a freed block), a cap on the scores, and sinks (each
// lane's running max starts at its head's logit and its running sum at 1).
template <int kD>
void attend_tile(const Tile& tile, const bf16* q, const bf16* kc, const bf16* vc, const int64_t* table, bf16* out,
                 int64_t num_heads, int64_t groups, int64_t token_stride, int64_t table_block, float scale,
                 TileScratch<kD>& w, const pagedrl_cpu::RowRules& rules) {
  const float lowest = -std::numeric_limits<float>::max();
  const int64_t h = tile.head, heads = tile.rows * groups;
  const int64_t len = tile.first_pos + tile.rows;  // the tile's last row sees every key before it
  const int64_t lo = rules.window > 0 ? std::max<int64_t>(0, tile.first_pos - rules.window + 1) : 0;
  for (int64_t m = 0; m < kTileHeads; ++m) {
    const int64_t row = tile.first_row + m / groups;
    const uint32_t* query = m < heads
        ? reinterpret_cast<const uint32_t*>(q + (row * num_heads + h * groups + m % groups) * kD) : w.zeros.data();
    for (int j = 0; j < kD / 2; ++j) w.query_pairs[j * kTileHeads + m] = query[j];
    w.position[m] = m < heads ? static_cast<int32_t>(tile.first_pos + m / groups) : -1;
  }
  std::fill(w.acc, w.acc + kTileHeads * kD, 0.f);
  __m512 running_max[kHeadVectors], running_sum[kHeadVectors];
  __m512i position[kHeadVectors];
  __m512i lowest_key[kHeadVectors];  // per lane: its row's first key (window)
  for (int m = 0; m < kTileHeads; ++m) {  // a sink: one more column of the softmax, with no value
    w.rescale[m] = rules.sinks && m < heads ? rules.sinks[h * groups + m % groups] : lowest;
    w.sum[m] = rules.sinks && m < heads ? 1.f : 0.f;
  }
  for (int v = 0; v < kHeadVectors; ++v) {
    running_max[v] = _mm512_load_ps(w.rescale + kLanes * v);
    running_sum[v] = _mm512_load_ps(w.sum + kLanes * v);
    position[v] = _mm512_load_si512(w.position + kLanes * v);
    lowest_key[v] = _mm512_sub_epi32(position[v], _mm512_set1_epi32(static_cast<int32_t>(
        rules.window > 0 ? rules.window - 1 : std::numeric_limits<int32_t>::max() / 2)));
  }
  const uint32_t* keys[kChunk];
  const uint16_t* values[kChunk];
  int64_t slots[kChunk];
  for (int64_t first = lo / kChunk * kChunk; first < len; first += kChunk) {
    const int64_t n = std::min(kChunk, len - first);
    pagedrl_cpu::tile_chunk_slots(first, n, lo, table, table_block, slots);
    for (int64_t t = 0; t < kChunk; ++t) {
      keys[t] = slots[t] < 0 ? w.zeros.data() : reinterpret_cast<const uint32_t*>(kc + slots[t] * token_stride + h * kD);
      values[t] = slots[t] < 0 ? reinterpret_cast<const uint16_t*>(w.zeros.data())
                               : reinterpret_cast<const uint16_t*>(vc + slots[t] * token_stride + h * kD);
    }
    const int64_t pairs = (n + 1) / 2;
    for (int64_t j = 0; j < pairs; ++j)
      for (int i = 0; i < kD / 16; ++i) {
        const auto* even = reinterpret_cast<const __m256i*>(values[2 * j] + 16 * i);
        const auto* odd = reinterpret_cast<const __m256i*>(values[2 * j + 1] + 16 * i);
        _mm512_store_si512(w.value_pairs + j * 2 * kD + 32 * i,
                           interleave16(_mm256_loadu_si256(even), _mm256_loadu_si256(odd)));
      }
    key_block_scores<kD>(w, keys, 0, scale);
    if (n > kKeyBlock) key_block_scores<kD>(w, keys, kKeyBlock, scale);
    if (rules.softcap > 0.f)
      for (int64_t i = 0; i < n * kHeadVectors; ++i)
        _mm512_store_ps(w.probs + kLanes * i, soft_cap16(_mm512_load_ps(w.probs + kLanes * i), rules.softcap));
    // The online softmax, every head at once: lane m's max over the chunk's keys it sees, then its
    // probabilities; a key after a lane's row (or past the chunk) is not seen and weighs 0.
    for (int v = 0; v < kHeadVectors; ++v) {
      __m512 chunk_max = _mm512_set1_ps(lowest);
      for (int64_t t = 0; t < n; ++t) {
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(first + t));
        const __mmask16 seen = _mm512_cmp_epi32_mask(key, position[v], _MM_CMPINT_LE) &
                               _mm512_cmp_epi32_mask(key, lowest_key[v], _MM_CMPINT_NLT);
        chunk_max = _mm512_mask_max_ps(chunk_max, seen, chunk_max, _mm512_load_ps(w.probs + t * kTileHeads + kLanes * v));
      }
      const __m512 new_max = _mm512_max_ps(running_max[v], chunk_max);
      const __m512 rescale = pagedrl_cpu::exp_nonpositive16(_mm512_sub_ps(running_max[v], new_max));
      __m512 chunk_sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(first + t));
        const __mmask16 seen = _mm512_cmp_epi32_mask(key, position[v], _MM_CMPINT_LE) &
                               _mm512_cmp_epi32_mask(key, lowest_key[v], _MM_CMPINT_NLT);
        float* scores = w.probs + t * kTileHeads + kLanes * v;
        const __m512 p = _mm512_maskz_mov_ps(
            seen, pagedrl_cpu::exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(scores), new_max)));
        chunk_sum = _mm512_add_ps(chunk_sum, p);
        _mm512_store_ps(scores, p);
      }
      for (int64_t j = 0; j < (n + 1) / 2; ++j) {  // positions past n hold probability 0
        const __m512 even = _mm512_load_ps(w.probs + 2 * j * kTileHeads + kLanes * v);
        const __m512 odd = 2 * j + 1 < n ? _mm512_load_ps(w.probs + (2 * j + 1) * kTileHeads + kLanes * v)
                                         : _mm512_setzero_ps();
        _mm512_store_si512(w.prob_pairs + j * kTileHeads + kLanes * v,
                           interleave16((__m256i)_mm512_cvtneps_pbh(even), (__m256i)_mm512_cvtneps_pbh(odd)));
      }
      running_sum[v] = _mm512_fmadd_ps(running_sum[v], rescale, chunk_sum);
      running_max[v] = new_max;
      _mm512_store_ps(w.rescale + kLanes * v, rescale);
    }
    for (int64_t m0 = 0; m0 < heads; m0 += kValueBlock<kD>) block_values<kD>(w, m0, (n + 1) / 2);
  }
  for (int v = 0; v < kHeadVectors; ++v) _mm512_store_ps(w.sum + kLanes * v, running_sum[v]);
  for (int64_t m = 0; m < heads; ++m) {
    const int64_t row = tile.first_row + m / groups;
    bf16* o = out + (row * num_heads + h * groups + m % groups) * kD;
    const float inv = 1.f / w.sum[m];
    for (int64_t d = 0; d < kD; ++d) o[d] = static_cast<bf16>(w.acc[m * kD + d] * inv);
  }
}
#endif

// q [N, Hq, D] bf16 or float32 (the caches alike), the rows of S sequences (sequence s owns rows
// query_start_loc[s]..[s+1], the last of them at position seq_lens[s] - 1); key_cache, value_cache
// [blocks, B, Hkv, D]; tables [S, entries].
// Returns [N, Hq, D]: each row attends causally over its sequence's keys up to its own position. window > 0:
// a row sees its last `window` keys only (and reads no other); softcap > 0: scores capped; sinks [Hq] float32:
// a logit per head in each denominator (`RowRules`).
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "paged_prefill: shapes");
  const bool f32 = q.scalar_type() == at::kFloat;
  const bool widened = f32 && key_cache.scalar_type() == at::kBFloat16;  // a float32 engine's bf16 cache
  TORCH_CHECK((f32 || q.scalar_type() == at::kBFloat16) &&
                  (key_cache.scalar_type() == q.scalar_type() || widened) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_prefill: q and the caches must be bfloat16, or float32, all three alike (or a float32 q "
              "over bfloat16 caches)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_prefill: caches must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong,
              "paged_prefill: tables, query_start_loc and seq_lens must be int64");
  const int64_t num_seqs = seq_lens.numel(), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = key_cache.size(2), table_block = key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "paged_prefill: heads");
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && tables.size(0) == num_seqs, "paged_prefill: one table and "
              "one length per sequence, S + 1 query starts");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_prefill: window and softcap must be >= 0 (0: none)");
  at::Tensor sink_values;
  pagedrl_cpu::RowRules rules;
  rules.window = window;
  rules.softcap = static_cast<float>(softcap);
  if (sinks.has_value()) {
    sink_values = sinks->contiguous();
    TORCH_CHECK(sink_values.scalar_type() == at::kFloat && sink_values.numel() == num_heads,
                "paged_prefill: sinks must be float32 [", num_heads, "]");
    rules.sinks = sink_values.data_ptr<float>();
  }
  TORCH_CHECK(head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 ||
                  head_dim == 256,
              "paged_prefill: head_dim 16, 32, 64, 96, 128 or 256, got ", head_dim);
  const auto qc = q.contiguous(), table = tables.contiguous(), starts = query_start_loc.contiguous(),
             lens = seq_lens.contiguous();
  const int64_t* qsl = starts.data_ptr<int64_t>();
  const int64_t* seq_len = lens.data_ptr<int64_t>();
  TORCH_CHECK(qsl[num_seqs] == q.size(0), "paged_prefill: query_start_loc must end at the number of rows");
  const int64_t groups = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
#if PAGEDRL_F32_CHUNKS
  const int64_t rows_per_tile = tile_rows(groups, f32 ? pagedrl_cpu::kF32TileHeads : kTileHeads);
#else
  const int64_t rows_per_tile = tile_rows(groups, kTileHeads);
#endif
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s], first_pos = seq_len[s] - q_len;
    TORCH_CHECK(q_len >= 1 && first_pos >= 0, "paged_prefill: sequence ", s, " has ", q_len, " rows and ",
                seq_len[s], " tokens");
    for (int64_t r = 0; r < q_len; r += rows_per_tile) {
      const int64_t rows = std::min(rows_per_tile, q_len - r);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        tiles.push_back({s, qsl[s] + r, rows, first_pos + r, h,
                         rows * (window > 0 ? std::min(first_pos + r + rows, window + rows) : first_pos + r + rows)});
    }
  }
  // The order tiles go in: a sequence's tiles together, one KV head's after another, each head's largest
  // first (the sequences largest first), so that a tile finds the keys and values its sequence's last
  // tile read still in L2 (or L3, the other thread's). One layer of 64 prompts of 32-512 tokens, two
  // threads, ms: float32 as AVX2 122 -> 80 (the row kernel 106), on AVX512 88 -> 70, bf16 40 -> 35,
  // against every tile largest first across the sequences (which read most tiles' keys from memory).
  std::vector<int64_t> seq_cost(num_seqs, 0);
  for (const Tile& t : tiles) seq_cost[t.seq] += t.cost;
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) {
    if (a.seq != b.seq) return seq_cost[a.seq] != seq_cost[b.seq] ? seq_cost[a.seq] > seq_cost[b.seq] : a.seq < b.seq;
    return a.head != b.head ? a.head < b.head : a.cost > b.cost;
  });
  auto out = at::empty_like(qc);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t stride = table.size(1);
  const float s = static_cast<float>(scale);
  // The step's tiles in `T` with head size kD: each thread with its own `TileState` and row scratch; a
  // tile of too few query heads (or a model with more than `tile_heads` a KV head) through the row
  // routine, row by row; the others through attend(tile, its sequence's table, the thread's state).
  auto run_tiles = [&](auto* type, auto* cache_type, auto kd, auto* state, int64_t tile_heads, auto&& attend) {
    using T = std::remove_pointer_t<decltype(type)>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
    using TileState = std::remove_pointer_t<decltype(state)>;
    constexpr int kD = decltype(kd)::value;
    struct Scratch {
      TileState tile;
      pagedrl_cpu::RowScratch row;
    };
    const T* qp = qc.data_ptr<T>();
    const C* kp = key_cache.data_ptr<C>();
    const C* vp = value_cache.data_ptr<C>();
    T* op = out.data_ptr<T>();
    pagedrl_cpu::run_largest_first(
        static_cast<int64_t>(tiles.size()), [&] { return std::make_unique<Scratch>(); },
        [&](std::unique_ptr<Scratch>& w, int64_t i) {
          const Tile& tile = tiles[i];
          const int64_t* seq_table = tp + tile.seq * stride;
          if (tile.rows * groups < kMinTileHeads || groups > tile_heads) {
            for (int64_t r = 0; r < tile.rows; ++r)
              pagedrl_cpu::attend_row<T, kD, C>(qp, kp, vp, seq_table, tile.first_row + r, tile.head, 1,
                                                tile.first_pos + r + 1, op, nullptr, num_heads, groups, kD,
                                                token_stride, table_block, s, w->row, rules);
          } else {
            attend(tile, qp, kp, vp, seq_table, op, w->tile);
          }
        });
  };
  auto by_head_dim = [&](auto&& run) {
    switch (head_dim) {
      case 16: run(std::integral_constant<int, 16>{}); break;
      case 32: run(std::integral_constant<int, 32>{}); break;
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 96: run(std::integral_constant<int, 96>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      default: run(std::integral_constant<int, 256>{}); break;
    }
  };
  if (f32) {
#if PAGEDRL_F32_CHUNKS
    auto run_f32 = [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      by_head_dim([&](auto kd) {
        constexpr int kD = decltype(kd)::value;
        run_tiles(static_cast<float*>(nullptr), cache_type, kd, static_cast<pagedrl_cpu::F32TileScratch<kD>*>(nullptr),
                  pagedrl_cpu::kF32TileHeads,
                  [&](const Tile& tile, const float* qp, const C* kp, const C* vp, const int64_t* seq_table,
                      float* op, pagedrl_cpu::F32TileScratch<kD>& w) {
                    pagedrl_cpu::attend_tile_f32<kD, C>(tile.first_row, tile.rows, tile.first_pos, tile.head, qp, kp,
                                                        vp, seq_table, op, num_heads, groups, token_stride,
                                                        table_block, s, w, rules);
                  });
      });
    };
    if (widened) run_f32(static_cast<bf16*>(nullptr));
    else run_f32(static_cast<float*>(nullptr));
    return out;
#else
    TORCH_CHECK(false, "paged_prefill: this build has no float32 vector chunks (AVX2 with FMA, or AVX512F)");
#endif
  }
#if PAGEDRL_BF16_DOT
  by_head_dim([&](auto kd) {
    constexpr int kD = decltype(kd)::value;
    run_tiles(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr), kd, static_cast<TileScratch<kD>*>(nullptr),
              kTileHeads,
              [&](const Tile& tile, const bf16* qp, const bf16* kp, const bf16* vp, const int64_t* seq_table, bf16* op,
                  TileScratch<kD>& w) {
                attend_tile<kD>(tile, qp, kp, vp, seq_table, op, num_heads, groups, token_stride, table_block, s, w,
                                rules);
              });
  });
  return out;
#else
  TORCH_CHECK(false, "paged_prefill: this build has no AVX512-BF16 dot products");
#endif
}

// Whether this build attends float32 prompt chunks in tiles (`prefill_tiles_f32.h`: AVX2 with FMA, or AVX512F).
bool paged_prefill_float32() { return PAGEDRL_F32_CHUNKS; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("paged_prefill_float32() -> bool", &paged_prefill_float32);
  m.def("paged_prefill(Tensor q, Tensor key_cache, Tensor value_cache, Tensor tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0., Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
