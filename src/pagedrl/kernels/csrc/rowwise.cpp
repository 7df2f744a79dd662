// The decoder's row-wise pieces, each one pass over its rows, for the engine's bf16 and float32 steps on a CPU:
// RMSNorm, SiLU(gate) * up, and the rotary embedding of queries and keys; greedy decoding's pick from
// the logits; and a trainer's entropy of its log-probs.
//
// Why: in eager torch each is five to ten bf16 operations, each a pass over memory that widens to
// float32 and rounds back, plus a Python round trip. A prefill chunk of 2048 tokens spent a third of
// its time in them (SiLU and its product alone pass over 2048 x 1536 values three times), and a one-row
// decode step pays some 25 operator calls a layer. Here each is one call: float32 inside, bf16 out, with
// the roundings of the decoder's own code where it rounds between steps (the normalized row before
// its weight; SiLU's output before the product), and one rounding where the eager code rounds twice
// (the rotary sum).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <tuple>

#include "cpu_math.h"

namespace {

using pagedrl_cpu::bf16_to_float;
using pagedrl_cpu::exp_nonpositive;
using pagedrl_cpu::float_to_bf16;

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); }
uint16_t* bits_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); }

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), "rowwise: ", name, " must be contiguous bf16");
}

// The element types the row-wise kernels take: bf16 (each value widened to float32, the results rounded
// back where the decoder's own code rounds) and float32 (the same arithmetic, where every rounding back
// is to float32 and so no rounding at all).
struct Bf16 {
  using Bits = uint16_t;
  static const Bits* in(const at::Tensor& t) { return bits(t); }
  static Bits* out(at::Tensor& t) { return bits_out(t); }
  static float widen(Bits b) { return bf16_to_float(b); }
  static Bits store(float v) { return float_to_bf16(v); }
  static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

struct F32 {
  using Bits = float;
  static const Bits* in(const at::Tensor& t) { return t.data_ptr<float>(); }
  static Bits* out(at::Tensor& t) { return t.data_ptr<float>(); }
  static float widen(Bits b) { return b; }
  static Bits store(float v) { return v; }
  static float round(float v) { return v; }
};

// Whether the tensors are all contiguous float32 (the float32 kernels) or else all contiguous bf16
// (checked, naming `name` when not).
bool all_float32(std::initializer_list<const at::Tensor*> tensors, const char* name) {
  bool f32 = true;
  for (const auto* t : tensors) f32 = f32 && t->scalar_type() == at::kFloat && t->is_contiguous();
  if (!f32)
    for (const auto* t : tensors) check_bf16(*t, name);
  return f32;
}

// weight * round(x * rsqrt(mean(x^2) + eps)), each row of x [..., D].
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, double eps) {
  const int64_t D = x.size(-1), R = x.numel() / D;
  const typename T::Bits* xp = T::in(x);
  const typename T::Bits* wp = T::in(weight);
  typename T::Bits* yp = T::out(y);
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const typename T::Bits* row = xp + r * D;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < D; ++d) squares += T::widen(row[d]) * T::widen(row[d]);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(D) + epsilon);
      typename T::Bits* out = yp + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = T::store(T::widen(wp[d]) * T::round(T::widen(row[d]) * scale));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool f32 = all_float32({&x, &weight}, "x and weight");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "rms_norm: weight of ", D, " expected");
  at::Tensor y = at::empty_like(x);
  if (f32)
    rms_norm_rows<F32>(x, weight, y, eps);
  else
    rms_norm_rows<Bf16>(x, weight, y, eps);
  return y;
}

// round(silu(g)) * u, one value: sigmoid from exp(-|g|) <= 1, so no overflow either way.
template <typename T>
inline float silu_times(float g, float u) {
  const float e = exp_nonpositive(-std::fabs(g));
  const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return T::round(g * sigmoid) * u;
}

// round(silu(gate)) * up, elementwise.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const bool f32 = all_float32({&gate, &up}, "gate and up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up must have one shape");
  at::Tensor y = at::empty_like(gate);
  if (f32) {
    const float* gp = gate.data_ptr<float>();
    const float* up_ = up.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, gate.numel(), 4096, [&](int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) yp[i] = silu_times<F32>(gp[i], up_[i]);
    });
    return y;
  }
  const uint16_t* gp = bits(gate);
  const uint16_t* up_ = bits(up);
  uint16_t* yp = bits_out(y);
  at::parallel_for(0, gate.numel(), 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    using namespace pagedrl_cpu;
    for (; i + 16 <= end; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + i), silu_mul_bf16x16(load_bf16x16(gp + i), load_bf16x16(up_ + i)));
#endif
    for (; i < end; ++i)  // the same arithmetic, one value at a time
      yp[i] = float_to_bf16(silu_times<Bf16>(bf16_to_float(gp[i]), bf16_to_float(up_[i])));
  });
  return y;
}

// x [T, H, D] rotated by position: x * cos + rotate_half(x) * sin, cos/sin [T, D] (HF's half layout).
template <typename T>
void rotate(const typename T::Bits* x, const typename T::Bits* cos, const typename T::Bits* sin,
            typename T::Bits* y, int64_t tokens, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / H;
      const typename T::Bits* row = x + item * D;
      const typename T::Bits* c = cos + t * D;
      const typename T::Bits* s = sin + t * D;
      typename T::Bits* out = y + item * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d)
        out[d] = T::store(T::widen(row[d]) * T::widen(c[d]) - T::widen(row[d + half]) * T::widen(s[d]));
#pragma omp simd
      for (int64_t d = half; d < D; ++d)
        out[d] = T::store(T::widen(row[d]) * T::widen(c[d]) + T::widen(row[d - half]) * T::widen(s[d]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin) {
  const bool f32 = all_float32({&q, &k, &cos, &sin}, "q, k, cos and sin");
  const int64_t D = q.size(-1), T = cos.numel() / D;
  TORCH_CHECK(k.size(-1) == D && sin.numel() == cos.numel() && D % 2 == 0, "rope: shapes");
  TORCH_CHECK(q.numel() % (T * D) == 0 && k.numel() % (T * D) == 0, "rope: one cos/sin row per token");
  at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);
  if (f32) {
    rotate<F32>(F32::in(q), F32::in(cos), F32::in(sin), F32::out(qo), T, q.numel() / (T * D), D);
    rotate<F32>(F32::in(k), F32::in(cos), F32::in(sin), F32::out(ko), T, k.numel() / (T * D), D);
  } else {
    rotate<Bf16>(bits(q), bits(cos), bits(sin), bits_out(qo), T, q.numel() / (T * D), D);
    rotate<Bf16>(bits(k), bits(cos), bits(sin), bits_out(ko), T, k.numel() / (T * D), D);
  }
  return {qo, ko};
}

// -sum_v exp(l_v) * l_v of each row of finite log-probs l [R, V] (float32): a trainer's entropy metric
// in one read of the rows, where torch makes a [R, V] copy for exp and another for the product (400 MB
// for a 1024-row chunk of a 49k vocabulary, fresh pages a step could not reuse). Log-probs are <= 0,
// which exp_nonpositive wants. Each term is rounded to float32 once and summed in float64 (16 lanes under
// AVX512, added at the end; in order elsewhere), so the result is within the terms' own rounding
// (exp's 2e-7 and the product's half ulp, relative to sum |p * l|) of the exact entropy whatever the
// vocabulary's size or the CPU class: a float32 sum of 49k terms could drift by thousands of ulps.
at::Tensor entropy_from_logprobs(const at::Tensor& logp) {
  TORCH_CHECK(logp.scalar_type() == at::kFloat && logp.dim() == 2 && logp.is_contiguous(),
              "entropy_from_logprobs: contiguous float32 [rows, vocab] expected");
  const int64_t R = logp.size(0), V = logp.size(1);
  at::Tensor out = at::empty({R}, logp.options());
  const float* lp = logp.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * V;
      int64_t v = 0;
      double total = 0.0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
      for (; v + 16 <= V; v += 16) {
        const __m512 l = _mm512_loadu_ps(row + v);
        const __m512 term = _mm512_mul_ps(pagedrl_cpu::exp_nonpositive16(l), l);
        low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(term)));
        high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(term), 1))));
      }
      total = _mm512_reduce_add_pd(_mm512_add_pd(low, high));
#endif
      for (; v < V; ++v) {
        const float term = exp_nonpositive(row[v]) * row[v];
        total += static_cast<double>(term);
      }
      op[r] = static_cast<float>(-total);
    }
  });
  return out;
}

// Greedy decoding's pick from each row of float32 logits [R, V]: the first index of the row's maximum m
// and its log-probability, -log(sum_v exp(l_v - m)) (log_softmax's (l - m) - log(sum) at l = m), in two
// reads of the row; a row holding a NaN or an infinity gets log-probability NaN (the caller's full path
// answers it). torch's log_softmax writes the whole [R, V] (12.6 MB for 64 rows of a 49k
// vocabulary) and the argmax reads it again, every decode step, for one value a row.
constexpr int64_t kPickBlock = 1024;  // 4 KB of logits

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "greedy_pick: contiguous float32 [rows, vocab] expected");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor tokens = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor logp = at::empty({R}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * V;
      // Blocks of the row small enough to stay in L1: the block's max, then its exponentials read it
      // again from there, so the row streams in once. The running sum is rescaled when the max grows
      // and kept in float64 (49k float32 terms one after another would carry ~1e-5 of relative error;
      // the exponentials themselves are within 2e-7).
      float m = -std::numeric_limits<float>::infinity(), probe = 0.f;  // probe: NaN if a NaN or infinity
      int64_t max_block = 0;
      double total = 0.0;
      for (int64_t block = 0; block < V; block += kPickBlock) {
        const int64_t n = std::min(kPickBlock, V - block);
        const float* x = row + block;
        float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max) reduction(+ : probe)
        for (int64_t v = 0; v < n; ++v) {
          block_max = std::max(block_max, x[v]);
          probe += x[v] * 0.f;
        }
        if (block_max > m) {
          total *= std::exp(static_cast<double>(m) - block_max);
          m = block_max;
          max_block = block;
        }
        float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t v = 0; v < n; ++v) block_sum += exp_nonpositive(x[v] - m);
        total += block_sum;
      }
      int64_t first = max_block;
      while (first < V - 1 && row[first] != m) ++first;
      tp[r] = first;
      op[r] = probe == 0.f ? static_cast<float>(-std::log(total)) : std::numeric_limits<float>::quiet_NaN();  // NaN: not served
    }
  });
  return {tokens, logp};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("entropy_from_logprobs(Tensor logp) -> Tensor");
  m.def("greedy_pick(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("entropy_from_logprobs", &entropy_from_logprobs);
  m.impl("greedy_pick", &greedy_pick);
}
