// A float32 linear layer's product for many rows (a prompt chunk, a decode step of more sequences than
// `float_linear` takes), in outer-product tiles for AVX2 + FMA.
//
// Why: above a few rows a projection is bound by its multiply-adds, not by its weights' bytes, and
// `float_linear`'s dot products end every output with a sum across lanes. MKL's float32 GEMM, which
// torch calls for `F.linear`, packs both operands on every call: capped to AVX2 on one thread it ran a
// decode step's 64 x 576 -> 1536 product at 76-80 GFLOP/s against 95-97 at a 2048-row chunk, and on
// two threads at 114-126 (`bench/RESULTS.md`, "Float32 products of many rows in outer-product tiles").
// Here the input rows are laid out once per call in panels of 16 rows, [k][16] (the small operand: a
// decode step's 64 rows of 576 are 147 KB), and the weights are read as they lie (the module's own
// tensor, any row stride; nothing to redo after an optimizer step): 6 weight rows' values at k
// broadcast against the panel's two vectors at k, 12 sums in registers, 8 loads to 12 fused
// multiply-adds. A block of panels sized to stay in L2 is run against every weight row before the next
// block, so a prompt chunk reads the weights from memory once per block. While a tile's first panel
// passes, the next tile's weight rows are asked for into L2 (a line every two k): a decode step reads
// each weight once, from memory, and without this 16 rows took 62 ms instead of 45 (one thread, capped
// to AVX2). A last panel of at most 8 rows (17-24, 33-40, ... rows) runs half tiles, its
// padding's multiply-adds left out: 17 rows 84 -> 73 ms against 45 for 16.
//
// Every output is one chain of K fused multiply-adds in k order from zero, then the bias added: a row's
// outputs are the same bits whatever its batch, its place in a panel or the thread, and the same
// without the vector instructions (std::fma in the same order).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPanelRows = 16;          // input rows a panel holds: two 8-lane vectors
constexpr int kTileRows = 6;            // weight rows a tile broadcasts: 12 sums of 16 registers
constexpr int64_t kTilesPerItem = 8;    // 48 weight rows a work item: the threads' grain
constexpr int64_t kMaxChunk = 768;      // the most k a tile's chain runs before the next panel's

// A block of panels' bytes, kept in L2 while every weight row passes: 3/8 of the core's L2 as the CPU
// reports it (384 KB of AMD Zen 4's 1 MB, where it was measured; 192 KB of Zen 2/3's 512 KB), 384 KB
// where it reports none. On Zen 4 (capped to AVX2, 2048 rows, K = 576 and 1536, one and two threads)
// blocks of 96, 192 and 384 KB ran level, so a smaller L2 loses nothing by the smaller block, while a
// block near the whole of it would have its panels evicted by the weight rows passing through.
int64_t block_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? std::clamp<int64_t>(l2 / 8 * 3, 64 << 10, 384 << 10) : int64_t{384 << 10};
  }();
  return bytes;
}

#if defined(__AVX2__) && defined(__FMA__)
// A tile's loops over k for `tile` and `half_tile`: STEP(off) is one k's loads and multiply-adds on the
// sums SUMS names; two k a loop step, the next tile's line asked for, then an odd last k alone. Uses
// the caller's panel, p, q (weight rows 0-2 and 3-5), ld (their stride in bytes), K and ahead.
#define PAGEDRL_TILE_LOOPS(STEP, SUMS)                                                                         \
  const int64_t pairs = K / 2;                                                                                 \
  if (pairs > 0) {                                                                                             \
    __asm__ volatile("mov %[x], %%r8\n\t"                                                                       \
                     "mov %[p], %%r9\n\t"                                                                       \
                     "mov %[q], %%r10\n\t"                                                                      \
                     "mov %[n], %%r11\n\t"                                                                      \
                     "mov %[a], %%r12\n\t"                                                                      \
                     "1:\n\t" STEP(0) STEP(1) "prefetcht1 (%%r12)\n\t"                                         \
                     "add $64, %%r12\n\t"                                                                       \
                     "add $128, %%r8\n\t"                                                                       \
                     "add $8, %%r9\n\t"                                                                         \
                     "add $8, %%r10\n\t"                                                                        \
                     "dec %%r11\n\t"                                                                            \
                     "jnz 1b\n\t"                                                                               \
                     : SUMS                                                                                    \
                     : [x] "r"(panel), [p] "r"(p), [q] "r"(q), [n] "r"(pairs), [ld] "r"(ld), [a] "r"(ahead)    \
                     : "r8", "r9", "r10", "r11", "r12", "xmm12", "xmm13", "xmm14", "cc", "memory");            \
  }                                                                                                            \
  if (K % 2) {                                                                                                 \
    __asm__ volatile("mov %[x], %%r8\n\t"                                                                       \
                     "mov %[p], %%r9\n\t"                                                                       \
                     "mov %[q], %%r10\n\t" STEP(0)                                                              \
                     : SUMS                                                                                    \
                     : [x] "r"(panel + 2 * pairs * kPanelRows), [p] "r"(p + 2 * pairs), [q] "r"(q + 2 * pairs), \
                       [ld] "r"(ld)                                                                            \
                     : "r8", "r9", "r10", "xmm12", "xmm13", "xmm14", "memory");                                \
  }
#endif

// out[j][m] (+)= sum_k w[j * ldw + k] * panel[k][m] for the tile's 6 weight rows and the panel's 16 rows:
// from zero, or on from the sums in `out` (`resume`: a chain continued over the next chunk of k).
inline void tile(const float* __restrict panel, const float* w, int64_t ldw, int64_t K,
                 float out[kTileRows][kPanelRows], bool resume, const char* ahead) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00,
         s40 = s00, s41 = s00, s50 = s00, s51 = s00;
  if (resume) {
    s00 = _mm256_loadu_ps(out[0]); s01 = _mm256_loadu_ps(out[0] + 8);
    s10 = _mm256_loadu_ps(out[1]); s11 = _mm256_loadu_ps(out[1] + 8);
    s20 = _mm256_loadu_ps(out[2]); s21 = _mm256_loadu_ps(out[2] + 8);
    s30 = _mm256_loadu_ps(out[3]); s31 = _mm256_loadu_ps(out[3] + 8);
    s40 = _mm256_loadu_ps(out[4]); s41 = _mm256_loadu_ps(out[4] + 8);
    s50 = _mm256_loadu_ps(out[5]); s51 = _mm256_loadu_ps(out[5] + 8);
  }
  // The loop in assembly: 12 sums, the panel's 2 vectors and a broadcast are 15 of AVX2's 16 registers,
  // and GCC's allocation of the same loop in C kept one sum on the stack (a load and a store a step).
  // Rows 0-2 of the tile at p, p + ld, p + 2 ld; rows 3-5 at q, q + ld, q + 2 ld (ld in bytes).
  const float* p = w;
  const float* q = w + 3 * ldw;
  const int64_t ld = ldw * static_cast<int64_t>(sizeof(float));
#define PAGEDRL_GEMM_STEP(off)                                           \
  "vmovups " #off "*64(%%r8), %%ymm12\n\t"                               \
  "vmovups " #off "*64+32(%%r8), %%ymm13\n\t"                            \
  "vbroadcastss " #off "*4(%%r9), %%ymm14\n\t"                           \
  "vfmadd231ps %%ymm12, %%ymm14, %[s00]\n\t"                             \
  "vfmadd231ps %%ymm13, %%ymm14, %[s01]\n\t"                             \
  "vbroadcastss " #off "*4(%%r9,%[ld]), %%ymm14\n\t"                     \
  "vfmadd231ps %%ymm12, %%ymm14, %[s10]\n\t"                             \
  "vfmadd231ps %%ymm13, %%ymm14, %[s11]\n\t"                             \
  "vbroadcastss " #off "*4(%%r9,%[ld],2), %%ymm14\n\t"                   \
  "vfmadd231ps %%ymm12, %%ymm14, %[s20]\n\t"                             \
  "vfmadd231ps %%ymm13, %%ymm14, %[s21]\n\t"                             \
  "vbroadcastss " #off "*4(%%r10), %%ymm14\n\t"                          \
  "vfmadd231ps %%ymm12, %%ymm14, %[s30]\n\t"                             \
  "vfmadd231ps %%ymm13, %%ymm14, %[s31]\n\t"                             \
  "vbroadcastss " #off "*4(%%r10,%[ld]), %%ymm14\n\t"                    \
  "vfmadd231ps %%ymm12, %%ymm14, %[s40]\n\t"                             \
  "vfmadd231ps %%ymm13, %%ymm14, %[s41]\n\t"                             \
  "vbroadcastss " #off "*4(%%r10,%[ld],2), %%ymm14\n\t"                  \
  "vfmadd231ps %%ymm12, %%ymm14, %[s50]\n\t"                             \
  "vfmadd231ps %%ymm13, %%ymm14, %[s51]\n\t"
// 12 sums in and out (24 of asm's 30 operands); the pointers copied into scratch registers.
#define PAGEDRL_GEMM_SUMS                                                                              \
  [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11), [s20] "+x"(s20), [s21] "+x"(s21), \
  [s30] "+x"(s30), [s31] "+x"(s31), [s40] "+x"(s40), [s41] "+x"(s41), [s50] "+x"(s50), [s51] "+x"(s51)
  PAGEDRL_TILE_LOOPS(PAGEDRL_GEMM_STEP, PAGEDRL_GEMM_SUMS)
#undef PAGEDRL_GEMM_SUMS
#undef PAGEDRL_GEMM_STEP
  _mm256_storeu_ps(out[0], s00); _mm256_storeu_ps(out[0] + 8, s01);
  _mm256_storeu_ps(out[1], s10); _mm256_storeu_ps(out[1] + 8, s11);
  _mm256_storeu_ps(out[2], s20); _mm256_storeu_ps(out[2] + 8, s21);
  _mm256_storeu_ps(out[3], s30); _mm256_storeu_ps(out[3] + 8, s31);
  _mm256_storeu_ps(out[4], s40); _mm256_storeu_ps(out[4] + 8, s41);
  _mm256_storeu_ps(out[5], s50); _mm256_storeu_ps(out[5] + 8, s51);
#else
  (void)ahead;
  if (!resume)
    for (int j = 0; j < kTileRows; ++j)
      for (int m = 0; m < kPanelRows; ++m) out[j][m] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < kTileRows; ++j)
      for (int m = 0; m < kPanelRows; ++m) out[j][m] = std::fma(w[j * ldw + k], panel[k * kPanelRows + m], out[j][m]);
#endif
}

// `tile` for a panel whose rows past 8 are all padding (the last panel of 17-24, 33-40, ... rows): the
// same 6 weight rows against the panel's first vector only, 6 sums, half the multiply-adds. Lanes 0-7
// of `out` are written (and read when resuming); each is the same chain, so the same bits, as `tile`'s.
inline void half_tile(const float* __restrict panel, const float* w, int64_t ldw, int64_t K,
                      float out[kTileRows][kPanelRows], bool resume, const char* ahead) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0;
  if (resume) {
    s0 = _mm256_loadu_ps(out[0]); s1 = _mm256_loadu_ps(out[1]); s2 = _mm256_loadu_ps(out[2]);
    s3 = _mm256_loadu_ps(out[3]); s4 = _mm256_loadu_ps(out[4]); s5 = _mm256_loadu_ps(out[5]);
  }
  const float* p = w;
  const float* q = w + 3 * ldw;
  const int64_t ld = ldw * static_cast<int64_t>(sizeof(float));
#define PAGEDRL_HALF_STEP(off)                                           \
  "vmovups " #off "*64(%%r8), %%ymm12\n\t"                               \
  "vbroadcastss " #off "*4(%%r9), %%ymm14\n\t"                           \
  "vfmadd231ps %%ymm12, %%ymm14, %[s0]\n\t"                              \
  "vbroadcastss " #off "*4(%%r9,%[ld]), %%ymm13\n\t"                     \
  "vfmadd231ps %%ymm12, %%ymm13, %[s1]\n\t"                              \
  "vbroadcastss " #off "*4(%%r9,%[ld],2), %%ymm14\n\t"                   \
  "vfmadd231ps %%ymm12, %%ymm14, %[s2]\n\t"                              \
  "vbroadcastss " #off "*4(%%r10), %%ymm13\n\t"                          \
  "vfmadd231ps %%ymm12, %%ymm13, %[s3]\n\t"                              \
  "vbroadcastss " #off "*4(%%r10,%[ld]), %%ymm14\n\t"                    \
  "vfmadd231ps %%ymm12, %%ymm14, %[s4]\n\t"                              \
  "vbroadcastss " #off "*4(%%r10,%[ld],2), %%ymm13\n\t"                  \
  "vfmadd231ps %%ymm12, %%ymm13, %[s5]\n\t"
#define PAGEDRL_HALF_SUMS [s0] "+x"(s0), [s1] "+x"(s1), [s2] "+x"(s2), [s3] "+x"(s3), [s4] "+x"(s4), [s5] "+x"(s5)
  PAGEDRL_TILE_LOOPS(PAGEDRL_HALF_STEP, PAGEDRL_HALF_SUMS)
#undef PAGEDRL_HALF_SUMS
#undef PAGEDRL_HALF_STEP
  _mm256_storeu_ps(out[0], s0); _mm256_storeu_ps(out[1], s1); _mm256_storeu_ps(out[2], s2);
  _mm256_storeu_ps(out[3], s3); _mm256_storeu_ps(out[4], s4); _mm256_storeu_ps(out[5], s5);
#else
  (void)ahead;
  if (!resume)
    for (int j = 0; j < kTileRows; ++j)
      for (int m = 0; m < kPanelRows / 2; ++m) out[j][m] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < kTileRows; ++j)
      for (int m = 0; m < kPanelRows / 2; ++m)
        out[j][m] = std::fma(w[j * ldw + k], panel[k * kPanelRows + m], out[j][m]);
#endif
}

#if defined(__AVX2__)
// dst[k * 16 + i] = src[i * lds + k] for 8 rows i and 8 columns k: an 8 x 8 transpose in registers.
inline void transpose8(const float* src, int64_t lds, float* dst) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * kPanelRows, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * kPanelRows, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

// Rows [p * 16, p * 16 + 16) of x as panel p, [K][16], zeros for rows past M: 8 rows x 8 columns at a
// time by transposes where they are whole, one value at a time for the rest.
void lay_out_panel(const float* x, int64_t M, int64_t ldx, int64_t K, float* panels, int64_t p) {
  float* dst = panels + p * K * kPanelRows;
  for (int64_t half = 0; half < kPanelRows; half += 8) {
    const int64_t first = p * kPanelRows + half, rows = std::max<int64_t>(0, std::min<int64_t>(8, M - first));
    int64_t k = 0;
#if defined(__AVX2__)
    if (rows == 8)
      for (; k + 8 <= K; k += 8) transpose8(x + first * ldx + k, ldx, dst + k * kPanelRows + half);
#endif
    for (; k < K; ++k)
      for (int64_t m = 0; m < 8; ++m) dst[k * kPanelRows + half + m] = m < rows ? x[(first + m) * ldx + k] : 0.f;
  }
}

// x [M, K] float32 (rows contiguous, any row stride), weight [N, K] float32 (the same), bias [N] or
// none -> [M, N] float32.
at::Tensor float_gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "float_gemm: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "float_gemm: float32 x and weight expected");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "float_gemm: rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "float_gemm: float32 bias [", N, "] expected");
    bias_c = bias->contiguous();
  }
  if (M == 0 || N == 0 || K == 0) {  // no products: the bias, or zeros
    at::Tensor y = at::zeros({M, N}, x.options());
    return bias_c.defined() ? y.add_(bias_c) : y;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t num_panels = (M + kPanelRows - 1) / kPanelRows;
  at::Tensor panels = at::empty({num_panels, K, kPanelRows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* pp = panels.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) lay_out_panel(xp, M, ldx, K, pp, p);
  });
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldw = weight.stride(0);
  // k in chunks of at most kMaxChunk: a tile's 6 weight rows of a chunk stay in L1 (18 KB) while the
  // block's panels pass, and a block holds more panels (down_proj's K = 1536: the whole rows, 36 KB,
  // overflowed L1, and 3 panels a block reused each weight 3 times from it).
  const int64_t chunks = (K + kMaxChunk - 1) / kMaxChunk, chunk = (K + chunks - 1) / chunks;
  // Blocks of equal size: 16 panels as 10 + 6 left one of two threads idle for 4 of the 10 panels' time.
  const int64_t most_per_block = std::max<int64_t>(1, block_bytes() / (chunk * kPanelRows * 4));
  const int64_t blocks = (num_panels + most_per_block - 1) / most_per_block;
  const int64_t panels_per_block = (num_panels + blocks - 1) / blocks;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  // The last panel when it holds at most 8 rows: its padding's multiply-adds left out (`half_tile`).
  const int64_t half_panel = M - (num_panels - 1) * kPanelRows <= kPanelRows / 2 ? num_panels - 1 : -1;
  const int64_t items_per_block = (tiles + kTilesPerItem - 1) / kTilesPerItem;
  // Items in block order: with the static split, each thread takes whole blocks of panels where there
  // are several (a prompt chunk) and a share of the weight rows where there is one (a decode step).
  at::parallel_for(0, blocks * items_per_block, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(panels_per_block * kTileRows * kPanelRows);  // a tile's sums for each panel of the block
    std::vector<float> last;  // the last tile's rows and zeros after them, where N is not a multiple of 6
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / items_per_block, first_tile = item % items_per_block * kTilesPerItem;
      const int64_t p_end = std::min(num_panels, (block + 1) * panels_per_block);
      for (int64_t t = first_tile; t < std::min(tiles, first_tile + kTilesPerItem); ++t) {
        const int64_t n0 = t * kTileRows, rows = std::min<int64_t>(kTileRows, N - n0);
        const float* w = wp + n0 * ldw;
        int64_t w_stride = ldw;
        if (rows < kTileRows) {
          last.assign(kTileRows * K, 0.f);
          for (int64_t j = 0; j < rows; ++j) std::copy(w + j * ldw, w + j * ldw + K, last.begin() + j * K);
          w = last.data();
          w_stride = K;
        }
        const int64_t p_begin = block * panels_per_block;
        const char* next = reinterpret_cast<const char*>(wp + (t + 1 < tiles ? n0 + kTileRows : n0) * ldw);
        for (int64_t c0 = 0; c0 < K; c0 += chunk)
          for (int64_t p = p_begin; p < p_end; ++p)
            (p == half_panel ? half_tile : tile)(
                pp + (p * K + c0) * kPanelRows, w + c0, w_stride, std::min(chunk, K - c0),
                reinterpret_cast<float(*)[kPanelRows]>(sums.data() + (p - p_begin) * kTileRows * kPanelRows), c0 > 0,
                next + c0 * 32);
        for (int64_t p = p_begin; p < p_end; ++p) {
          const float(*out)[kPanelRows] = reinterpret_cast<const float(*)[kPanelRows]>(
              sums.data() + (p - p_begin) * kTileRows * kPanelRows);
          const int64_t m0 = p * kPanelRows, panel_rows = std::min<int64_t>(kPanelRows, M - m0);
          for (int64_t m = 0; m < panel_rows; ++m) {
            float* dst = yp + (m0 + m) * N + n0;
            for (int64_t j = 0; j < rows; ++j) dst[j] = out[j][m] + (bp ? bp[n0 + j] : 0.f);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) { m.def("float_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedrl_cpu, CPU, m) { m.impl("float_gemm", &float_gemm); }
