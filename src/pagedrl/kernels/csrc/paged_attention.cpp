// Attention that reads keys and values where they lie (CPU), one query row at a time.
//
// Row r is a query of sequence row_seqs[r] at position row_lens[r] - 1: it attends over that sequence's
// first row_lens[r] keys, found through the sequence's table (entry i holds table_block consecutive
// slots). A decode step is one row per sequence at its last position; a prefill is one row per new
// token; a trainer's packed batch is one row per token with a table of block 1 listing the tokens it
// sees. Work items are (row, KV head) pairs; the G query heads that share a KV head are attended
// together, so each key and value is read once for all of them. Keys are taken kChunk positions at a
// time: the chunk's scores, then an online-softmax update (running max and sum, the accumulator
// rescaled when the max grows), all in float32 whatever the dtype.
//
// Why the chunks are counted in positions, not in table blocks: a row's result depends only on its
// query and the keys and values at its positions, never on where they lie, how many other rows there
// are or how the cache is blocked. The engine's decode of a token and a trainer's forward over the
// finished sequence compute that token's attention bit for bit alike (batch-invariant attention).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_rows.h"

namespace {

using pagedrl_cpu::exp_nonpositive;
using pagedrl_cpu::load_row;

// Work items are rows, each with all its KV heads, when there are rows enough to keep every thread busy
// (a slot's heads lie side by side: one contiguous read of each block); else (row, KV head) pairs, so
// that a single decode still spreads over the threads. Either way each head's result is the same.
// (Handed out largest first, as the prefill tiles are, a decode step of 64 rows of 96-576 keys took as
// long: it waits on memory, which a thread left alone has to itself.) C: the cache's element (`attend_row`).
template <typename T, int kD, typename C>
void attend_rows(const T* q, const C* kc, const C* vc, const int64_t* tables, const int64_t* row_seqs,
                 const int64_t* row_lens, T* out, float* lse, int64_t num_rows, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim_rt, int64_t table_block, int64_t table_stride, float scale,
                 const pagedrl_cpu::RowRules& rules) {
  const int64_t head_dim = kD ? kD : head_dim_rt;
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // one slot
  const int64_t per_item = num_rows >= 4 * at::get_num_threads() ? num_kv_heads : 1;  // KV heads an item takes
  const int64_t items_per_row = num_kv_heads / per_item;
  at::parallel_for(0, num_rows * items_per_row, 1, [&](int64_t begin, int64_t end) {
    pagedrl_cpu::RowScratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / items_per_row, h0 = item % items_per_row * per_item;
      const int64_t* table = tables + (row_seqs ? row_seqs[r] : r) * table_stride;
      // Whole rows a thread takes in turn: the next one's first chunk asked for during this one's last.
      int64_t next_slot = 0, next_n = 0;
      if (items_per_row == 1 && item + 1 < end && rules.window == 0 && table_block % pagedrl_cpu::kChunk == 0) {
        const int64_t* next_table = tables + (row_seqs ? row_seqs[r + 1] : r + 1) * table_stride;
        next_slot = next_table[0] * table_block;
        next_n = std::min(pagedrl_cpu::kChunk, row_lens[r + 1]);
      }
      pagedrl_cpu::attend_row<T, kD, C>(q, kc, vc, table, r, h0, per_item, row_lens[r], out, lse, num_heads, groups,
                                     head_dim, token_stride, table_block, scale, scratch, rules, next_slot, next_n);
    }
  });
}

template <typename T, typename C>
void dispatch(const T* q, const C* kc, const C* vc, const int64_t* tables, const int64_t* row_seqs,
              const int64_t* row_lens, T* out, float* lse, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t table_block, int64_t table_stride, float scale,
              const pagedrl_cpu::RowRules& rules) {
  auto run = [&](auto kernel) {
    kernel(q, kc, vc, tables, row_seqs, row_lens, out, lse, num_rows, num_heads, num_kv_heads, head_dim, table_block,
           table_stride, scale, rules);
  };
  if (head_dim == 64) return run(attend_rows<T, 64, C>);
  if (head_dim == 128) return run(attend_rows<T, 128, C>);
  return run(attend_rows<T, 0, C>);
}

// q [N, Hq, D]; key_cache, value_cache [slots / table_block, table_block, Hkv, D] (contiguous; q's dtype, or
// bf16 under a float32 q: a float32 engine's bf16 cache, widened as read); tables
// [S, entries] int64; row_seqs [N] int64, or empty for row r = sequence r; row_lens [N] int64 (each >= 1).
// Returns [N, Hq, D] in q's dtype and, when with_lse, the log-sum-exp of each row's scaled scores [N, Hq]
// (float32; what a flash-attention backward needs), else an empty tensor. window > 0: row r sees only its
// last `window` keys; softcap > 0: scores capped; sinks [Hq] float32: a logit per head in each denominator
// (`RowRules`; the backward below knows none of them).
std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                                   const at::Tensor& value_cache, const at::Tensor& tables,
                                                   const at::Tensor& row_seqs, const at::Tensor& row_lens,
                                                   double scale, bool with_lse, int64_t window, double softcap,
                                                   const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention: shapes");
  const bool widened = q.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((q.scalar_type() == key_cache.scalar_type() || widened) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: the caches must share q's dtype, or be bfloat16 under a float32 q");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && row_lens.scalar_type() == at::kLong &&
                  row_seqs.scalar_type() == at::kLong,
              "paged_attention: tables, row_seqs and row_lens must be int64");
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "paged_attention: heads");
  TORCH_CHECK(row_lens.numel() == num_rows && (row_seqs.numel() == 0 || row_seqs.numel() == num_rows),
              "paged_attention: one length (and sequence) per row");
  auto qc = q.contiguous();
  auto table = tables.contiguous();
  auto seqs = row_seqs.contiguous();
  auto lens = row_lens.contiguous();
  auto out = at::empty_like(qc);
  auto lse = with_lse ? at::empty({num_rows, num_heads}, q.options().dtype(at::kFloat)) : at::empty({0}, q.options().dtype(at::kFloat));
  float* lse_ptr = with_lse ? lse.data_ptr<float>() : nullptr;
  const int64_t* seq_ptr = seqs.numel() ? seqs.data_ptr<int64_t>() : nullptr;
  const float s = static_cast<float>(scale);
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention: window and softcap must be >= 0 (0: none)");
  pagedrl_cpu::RowRules rules;
  rules.window = window;
  rules.softcap = static_cast<float>(softcap);
  at::Tensor sink_values;
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->numel() == num_heads, "paged_attention: one sink per query head");
    sink_values = sinks->to(at::kFloat).contiguous();
    rules.sinks = sink_values.data_ptr<float>();
  }
  if (widened) {
    using bf = c10::BFloat16;
    dispatch<float, bf>(qc.data_ptr<float>(), key_cache.data_ptr<bf>(), value_cache.data_ptr<bf>(),
                        table.data_ptr<int64_t>(), seq_ptr, lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse_ptr,
                        num_rows, num_heads, num_kv_heads, head_dim, key_cache.size(1), table.size(1), s, rules);
  } else if (q.scalar_type() == at::kFloat) {
    dispatch<float, float>(qc.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                    table.data_ptr<int64_t>(), seq_ptr, lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse_ptr,
                    num_rows, num_heads, num_kv_heads, head_dim, key_cache.size(1), table.size(1), s, rules);
  } else if (q.scalar_type() == at::kBFloat16) {
    using bf = c10::BFloat16;
    dispatch<bf, bf>(qc.data_ptr<bf>(), key_cache.data_ptr<bf>(), value_cache.data_ptr<bf>(), table.data_ptr<int64_t>(),
                 seq_ptr, lens.data_ptr<int64_t>(), out.data_ptr<bf>(), lse_ptr, num_rows, num_heads, num_kv_heads,
                 head_dim, key_cache.size(1), table.size(1), s, rules);
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return {out, lse};
}


// The gradient of attend_rows for a trainer: given dO, the forward's output O and log-sum-exp, each row
// recomputes its probabilities over the keys it saw (p = exp(s - lse)) and adds its share of dQ (its
// own), dK and dV (of the keys it read: summed over rows, in per-thread float32 buffers added at the end,
// so no two threads write one place). Only the keys a row saw are visited, where a dense backward
// over a packed batch of groups walks every pair of tokens and masks most of them.
template <typename T, int kD>
void attend_rows_backward(const T* dout, const T* q, const T* kc, const T* vc, const T* out, const float* lse,
                          const int64_t* tables, const int64_t* row_seqs, const int64_t* row_lens, T* dq, float* dk_all,
                          float* dv_all, int64_t num_slots, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim_rt, int64_t table_block, int64_t table_stride, float scale) {
  const int64_t head_dim = kD ? kD : head_dim_rt;
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t buffer = num_slots * token_stride;  // one thread's dK (and dV) accumulator
  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    float* dk_acc = dk_all + at::get_thread_num() * buffer;
    float* dv_acc = dv_all + at::get_thread_num() * buffer;
    std::vector<float> query(groups * head_dim), grad(groups * head_dim), dq_acc(groups * head_dim);
    std::vector<float> delta(groups), row_lse(groups), krow(head_dim), vrow(head_dim), orow(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t* table = tables + (row_seqs ? row_seqs[r] : r) * table_stride;
      const int64_t len = row_lens[r];
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at_head = (r * num_heads + h * groups + g) * head_dim;
        float* qg = query.data() + g * head_dim;
        float* gg = grad.data() + g * head_dim;
        load_row(q + at_head, qg, head_dim);
        load_row(dout + at_head, gg, head_dim);
        load_row(out + at_head, orow.data(), head_dim);
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < head_dim; ++i) d += gg[i] * orow[i];
        delta[g] = d;
        row_lse[g] = lse[r * num_heads + h * groups + g];
      }
      std::fill(dq_acc.begin(), dq_acc.end(), 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = table[p / table_block] * table_block + p % table_block;
        const int64_t at_key = slot * token_stride + h * head_dim;
        load_row(kc + at_key, krow.data(), head_dim);
        load_row(vc + at_key, vrow.data(), head_dim);
        float* dk = dk_acc + at_key;
        float* dv = dv_acc + at_key;
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = query.data() + g * head_dim;
          const float* gg = grad.data() + g * head_dim;
          float score = 0.f, dp = 0.f;
#pragma omp simd reduction(+ : score, dp)
          for (int64_t i = 0; i < head_dim; ++i) {
            score += qg[i] * krow[i];
            dp += gg[i] * vrow[i];
          }
          const float prob = exp_nonpositive(std::min(score * scale - row_lse[g], 0.f));
          const float ds = prob * (dp - delta[g]) * scale;
          float* dqg = dq_acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) {
            dv[i] += prob * gg[i];
            dk[i] += ds * qg[i];
            dqg[i] += ds * krow[i];
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* o = dq + (r * num_heads + h * groups + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) o[i] = static_cast<T>(dq_acc[g * head_dim + i]);
      }
    }
  });
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_typed(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& keys, const at::Tensor& values,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              const at::Tensor& tables, const at::Tensor& row_seqs,
                                                              const at::Tensor& row_lens, float scale) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = keys.size(2);
  const int64_t table_block = keys.size(1), num_slots = keys.size(0) * table_block;
  const int64_t threads = at::get_num_threads();
  auto dq = at::empty_like(q);
  auto dk_all = at::zeros({threads, num_slots, num_kv_heads, head_dim}, q.options().dtype(at::kFloat));
  auto dv_all = at::zeros_like(dk_all);
  const int64_t* seq_ptr = row_seqs.numel() ? row_seqs.data_ptr<int64_t>() : nullptr;
  auto run = [&](auto kernel) {
    kernel(dout.data_ptr<T>(), q.data_ptr<T>(), keys.data_ptr<T>(), values.data_ptr<T>(), out.data_ptr<T>(),
           lse.data_ptr<float>(), tables.data_ptr<int64_t>(), seq_ptr, row_lens.data_ptr<int64_t>(), dq.data_ptr<T>(),
           dk_all.data_ptr<float>(), dv_all.data_ptr<float>(), num_slots, num_rows, num_heads, num_kv_heads, head_dim,
           table_block, tables.size(1), scale);
  };
  if (head_dim == 64) run(attend_rows_backward<T, 64>);
  else if (head_dim == 128) run(attend_rows_backward<T, 128>);
  else run(attend_rows_backward<T, 0>);
  auto shape = keys.sizes();
  return {dq, dk_all.sum(0).to(keys.scalar_type()).view(shape), dv_all.sum(0).to(keys.scalar_type()).view(shape)};
}

// dq [N, Hq, D], dk and dv shaped as keys, for attend_rows's forward of the same arguments (its output
// `out` and log-sum-exp `lse` [N, Hq] float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& tables, const at::Tensor& row_seqs,
    const at::Tensor& row_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && dout.sizes() == q.sizes() &&
                  out.sizes() == q.sizes(),
              "paged_attention_backward: shapes");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "paged_attention_backward: lse must be float32 [N, Hq]");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "paged_attention_backward: one dtype for dout, q, keys, values and out");
  TORCH_CHECK(tables.scalar_type() == at::kLong && row_lens.scalar_type() == at::kLong &&
                  row_seqs.scalar_type() == at::kLong,
              "paged_attention_backward: tables, row_seqs and row_lens must be int64");
  const auto args = std::make_tuple(dout.contiguous(), q.contiguous(), keys.contiguous(), values.contiguous(),
                                    out.contiguous(), lse.contiguous(), tables.contiguous(), row_seqs.contiguous(),
                                    row_lens.contiguous());
  const float s = static_cast<float>(scale);
  auto call = [&](auto typed) {
    return std::apply([&](const auto&... a) { return typed(a..., s); }, args);
  };
  if (q.scalar_type() == at::kFloat) return call(backward_typed<float>);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention_backward: float32 or bfloat16 only");
  return call(backward_typed<c10::BFloat16>);
}

// k, v [N, Hkv, D] written to slots slot_mapping[N] of key_cache and value_cache ([slots / B, B, Hkv, D],
// contiguous). Two index_copy_ calls did the same; each cost an OpenMP region (tens of microseconds for
// a decode step's few kilobytes), 60 a step for the default model. Float32 keys and values into a bf16
// cache (a float32 engine's `kv_cache_dtype`) are rounded on the way, to nearest even as `Tensor.to` rounds:
// no float32 -> bf16 copy of the step's keys made first, a call a layer.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "store_kv: caches must be contiguous and alike");
  const bool rounded = k.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == key_cache.scalar_type() || rounded),
              "store_kv: k and v must share the caches' dtype, or be float32 for bfloat16 caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "store_kv: int64 slots");
  const int64_t n = slot_mapping.numel(), token = key_cache.size(2) * key_cache.size(3);
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(k.numel() == n * token && v.numel() == n * token, "store_kv: k and v must be [N, Hkv, D]");
  const auto kc = k.contiguous(), vc = v.contiguous(), where = slot_mapping.contiguous();
  const int64_t* slot = where.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "store_kv: slot out of range");
  if (rounded) {
    using bf = c10::BFloat16;
    const float* ksrc = kc.data_ptr<float>();
    const float* vsrc = vc.data_ptr<float>();
    bf* kdst = key_cache.data_ptr<bf>();
    bf* vdst = value_cache.data_ptr<bf>();
    at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t j = 0; j < token; ++j) {
          kdst[slot[i] * token + j] = bf(ksrc[i * token + j]);
          vdst[slot[i] * token + j] = bf(vsrc[i * token + j]);
        }
    });
    return;
  }
  const int64_t bytes = token * static_cast<int64_t>(k.element_size());
  const auto* ksrc = static_cast<const char*>(kc.data_ptr());
  const auto* vsrc = static_cast<const char*>(vc.data_ptr());
  auto* kdst = static_cast<char*>(key_cache.data_ptr());
  auto* vdst = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {  // one thread below 256 tokens
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kdst + slot[i] * bytes, ksrc + i * bytes, bytes);
      std::memcpy(vdst + slot[i] * bytes, vsrc + i * bytes, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedrl_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor tables, Tensor row_seqs, "
        "Tensor row_lens, float scale, bool with_lse, int window=0, float softcap=0., Tensor? sinks=None) "
        "-> (Tensor, Tensor)");
  m.def("paged_attention_backward(Tensor dout, Tensor q, Tensor keys, Tensor values, Tensor out, Tensor lse, "
        "Tensor tables, Tensor row_seqs, Tensor row_lens, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_backward", &paged_attention_backward);
  m.impl("store_kv", &store_kv);
}
