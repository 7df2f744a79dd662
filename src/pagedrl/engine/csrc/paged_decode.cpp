// Decode attention that reads the KV cache's blocks where they lie (CPU).
//
// One query per sequence (its newest token), attending over the sequence's seq_len cached keys, found
// through its block table. Work items are (sequence, KV head) pairs; the G query heads that share a KV
// head are attended together, so each key and value is read from memory once for all of them. Keys
// are taken a block at a time: the block's scores, then an online-softmax update (running max and sum,
// the accumulator rescaled when the max grows), all in float32 whatever the cache's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

// exp(x) for x <= 0 (scores minus their running max) in arithmetic the compiler vectorizes: 2^n * p(r)
// with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error below 2e-7, about
// one float32 ulp). A loop of std::exp stays scalar without -ffast-math, and it was most of the kernel.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below, exp underflows to a denormal; the rounding toward 0 is harmless here
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for exactness
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// kD, kBS: head_dim and block_size fixed at compile time (0: read at run time). With them fixed every
// inner loop has a constant trip count and vectorizes whole: 4x faster than the run-time-sized loops.
template <typename T, int kD, int kBS>
void decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim_rt, int64_t block_size_rt,
            int64_t table_stride, float scale) {
  const int64_t head_dim = kD ? kD : head_dim_rt;
  const int64_t block_size = kBS ? kBS : block_size_rt;
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // one cache slot
  const int64_t block_stride = block_size * token_stride;
  // Below every score, yet finite: exp(lowest - max) is 0 without an infinity in the arithmetic.
  const float lowest = -std::numeric_limits<float>::max();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(groups * head_dim), acc(groups * head_dim), scores(groups * block_size);
    std::vector<float> running_max(groups), running_sum(groups), row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[s];
      for (int64_t g = 0; g < groups; ++g) {
        float* qg = query.data() + g * head_dim;
        load_row(q + (s * num_heads + h * groups + g) * head_dim, qg, head_dim);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
        running_max[g] = lowest;
        running_sum[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0; first < len; first += block_size) {
        const int64_t n = std::min(block_size, len - first);  // a partial last block: its first n slots
        const int64_t base = tables[s * table_stride + first / block_size] * block_stride + h * head_dim;
        for (int64_t t = 0; t < n; ++t) {
          load_row(kc + base + t * token_stride, row.data(), head_dim);
          for (int64_t g = 0; g < groups; ++g) {
            const float* qg = query.data() + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
            scores[g * block_size + t] = dot;
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          float* sg = scores.data() + g * block_size;
          for (int64_t t = n; t < block_size; ++t) sg[t] = lowest;  // slots past the sequence: weight 0
          float new_max = running_max[g];
          for (int64_t t = 0; t < block_size; ++t) new_max = std::max(new_max, sg[t]);
          const float rescale = exp_nonpositive(running_max[g] - new_max);
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t t = 0; t < block_size; ++t) {
            sg[t] = exp_nonpositive(sg[t] - new_max);
            block_sum += sg[t];
          }
          running_sum[g] = running_sum[g] * rescale + block_sum;
          running_max[g] = new_max;
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= rescale;
        }
        for (int64_t t = 0; t < n; ++t) {
          load_row(vc + base + t * token_stride, row.data(), head_dim);
          const float* v = row.data();
          for (int64_t g = 0; g < groups; ++g) {
            const float p = scores[g * block_size + t];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* o = out + (s * num_heads + h * groups + g) * head_dim;
        const float inv = 1.f / running_sum[g];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

template <typename T>
void dispatch(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              int64_t table_stride, float scale) {
  auto run = [&](auto kernel) {
    kernel(q, kc, vc, tables, lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_stride,
           scale);
  };
  if (block_size == 16 && head_dim == 64) return run(decode<T, 64, 16>);
  if (block_size == 16 && head_dim == 128) return run(decode<T, 128, 16>);
  if (block_size == 16) return run(decode<T, 0, 16>);
  return run(decode<T, 0, 0>);
}

// q [S, Hq, D]; key_cache, value_cache [blocks, block_size, Hkv, D] (contiguous); block_tables [S, >= blocks
// of each sequence] int64; seq_lens [S] int64 (each >= 1). Returns [S, Hq, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "paged_decode: shapes");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type(),
              "paged_decode: q and the caches must share a dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block tables and lengths must be int64");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "paged_decode: heads");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(qc);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    dispatch<float>(qc.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), num_heads,
                  num_kv_heads, head_dim, key_cache.size(1), tables.size(1), s);
  } else if (q.scalar_type() == at::kBFloat16) {
    using bf = c10::BFloat16;
    dispatch<bf>(qc.data_ptr<bf>(), key_cache.data_ptr<bf>(), value_cache.data_ptr<bf>(), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), out.data_ptr<bf>(), q.size(0), num_heads, num_kv_heads, head_dim,
               key_cache.size(1), tables.size(1), s);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedrl_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
