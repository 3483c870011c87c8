// bf16_cpu.cpp's inner dot products with AVX512-BF16: VDPBF16PS multiplies bf16 pairs and sums them into fp32.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16_util.h"

namespace offload_native {

constexpr int64_t kPrefetchTiles = 8;  // how many tiles ahead gemv_block prefetches weight rows (hints never fault)

// y[r][m] = sum_k W[r][k] x[m][k] for R <= 4 weight rows and MR <= 4 rows of x: R x MR independent fp32
// accumulators in registers (a single chain per row would wait on VDPBF16PS's latency), each summed over k in
// ascending order, 32 at a time, the tail masked
template <int R, int MR>
inline void dot_tile(const bf16* w, int64_t ldw, const bf16* x, int64_t ldx, int64_t K, float* y, int64_t ldy,
                     const char* ahead) {
  __m512 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  // `ahead`: the R * K weights kPrefetchTiles tiles on in this thread's work (gemv_block), fetched one line per
  // row per step: a tile spans R short streams (a 256-wide row is 8 lines), too short for the hardware prefetcher
  // to ramp up on each, and a decode step is bound by this memory traffic
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (k / 32 * R + r) * 64, _MM_HINT_T0);
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (k < K) {
    __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) y[r * ldy + m] = _mm512_reduce_add_ps(acc[r][m]);
}

}  // namespace offload_native
