// float_linear's vector arithmetic, shared by every kernel whose products must equal its bits (the
// float32 decode products and gguf_linear's products on quantized weights): the lanes, the fused
// multiply-add, the load and the fixed tree that adds a sum's lanes.
#pragma once

#include <cstring>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedrl_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kWeightRows = 8;  // 16 sums + 8 weight vectors + 1 input vector of 32 registers
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kWeightRows = 4;  // 8 sums + 4 weight vectors + 1 input vector of 16 registers
#else
constexpr int kLanes = 4;
constexpr int kWeightRows = 4;
#endif
constexpr int kInputRows = 2;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

// acc + x * w rounded once (torch builds extensions in ISO C++, where GCC does not contract a * b + c).
inline Vec fused(Vec x, Vec w, Vec acc) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)x, (__m512)w, (__m512)acc);
#elif defined(__FMA__) && defined(__AVX__)
  return (Vec)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return x * w + acc;  // two roundings; the same in every tile all the same
#endif
}

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));  // an unaligned vector load
  return v;
}

inline float sum_lanes(Vec v) {  // one fixed tree: halves added until one lane is left
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

}  // namespace pagedrl_cpu
