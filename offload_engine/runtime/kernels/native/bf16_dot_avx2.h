// bf16_cpu.cpp's inner dot products with AVX2 and FMA (CPUs without AVX512-BF16): each bf16 widened to fp32 (its
// bits shifted up: exact) and multiplied-added in fp32.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "bf16_util.h"

namespace offload_native {

constexpr int64_t kPrefetchTiles = 8;  // how many tiles ahead gemv_block prefetches weight rows (hints never fault)

// 16 bf16 as two fp32 vectors: elements 0-3 and 8-11, then 4-7 and 12-15 (AVX2 unpacks stay within 128-bit
// halves); W and x are split alike, so the products pair up
inline void widen(const bf16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

inline float sum_lanes(__m256 v) {  // the 8 lanes in a fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 values of k for R weight rows and MR rows of x: every accumulator takes the low half, then the high half
template <int R, int MR>
inline void step16(__m256 (&acc)[R][MR], const bf16* w, int64_t ldw, const bf16* x, int64_t ldx) {
  __m256 xl[MR], xh[MR];
  for (int m = 0; m < MR; ++m) widen(x + m * ldx, xl[m], xh[m]);
  for (int r = 0; r < R; ++r) {
    __m256 wl, wh;
    widen(w + r * ldw, wl, wh);
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wh, xh[m], _mm256_fmadd_ps(wl, xl[m], acc[r][m]));
  }
}

// y[r][m] = sum_k W[r][k] x[m][k] for R <= 4 weight rows and MR <= 4 rows of x (two at a time: R x 2
// accumulators and x's two rows fill the 16 registers). Each output is one accumulator's lanes summed over k in
// ascending steps of 16, then reduced in a fixed order: the same bits whatever rows share the tile.
template <int R, int MR>
inline void dot_tile(const bf16* w, int64_t ldw, const bf16* x, int64_t ldx, int64_t K, float* y, int64_t ldy,
                     const char* ahead) {
  if constexpr (MR > 2) {
    dot_tile<R, 2>(w, ldw, x, ldx, K, y, ldy, ahead);
    dot_tile<R, MR - 2>(w, ldw, x + 2 * ldx, ldx, K, y + 2, ldy, ahead);
  } else {
    __m256 acc[R][MR];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
    // `ahead`: the R * K weights to prefetch, one line per row per 32 k (as bf16_dot_avx512.h says why)
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (k / 32 * R + r) * 64, _MM_HINT_T0);
      step16<R, MR>(acc, w + k, ldw, x + k, ldx);
      step16<R, MR>(acc, w + k + 16, ldw, x + k + 16, ldx);
    }
    for (; k + 16 <= K; k += 16) step16<R, MR>(acc, w + k, ldw, x + k, ldx);
    if (k < K) {  // the last K % 16 values, zero-padded copies
      bf16 wt[R][16] = {}, xt[MR][16] = {};
      for (int r = 0; r < R; ++r) std::memcpy(wt[r], w + r * ldw + k, (K - k) * sizeof(bf16));
      for (int m = 0; m < MR; ++m) std::memcpy(xt[m], x + m * ldx + k, (K - k) * sizeof(bf16));
      step16<R, MR>(acc, &wt[0][0], 16, &xt[0][0], 16);
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MR; ++m) y[r * ldy + m] = sum_lanes(acc[r][m]);
  }
}

}  // namespace offload_native
