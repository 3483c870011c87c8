// The input of int_cpu.cpp's kernels: a projection's bf16 rows quantized once per call, per block of 32 values, to
// two int8 digits (int_cpu.cpp's header says why and how they are multiplied).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16_util.h"

namespace offload_native {

constexpr int64_t kBlock = 32;  // inputs per scale (llama.cpp's Q8_0 block)
constexpr int64_t kChunk = 64;  // inputs per VPDPBUSD (two blocks: lanes 0-7 and 8-15)

struct Act {  // a projection's input as two int8 digits per block of 32, and the sums of x^ per group
  std::vector<int8_t> q, r;  // [M, Kp] each: Kp = K rounded up to kChunk, zero after K (x^ = (16 q + r) * scale)
  std::vector<float> lanes;  // [M, Kp / kChunk, 16]: each chunk's two block scales, one per VPDPBUSD lane
  std::vector<float> sums;  // [M, G]
  int64_t M = 0, K = 0, Kp = 0, G = 1;
  const void* source = nullptr;  // the bf16 rows it was made from (experts routed the same x share it)
  int64_t ldx = 0;
  const int8_t* row(int64_t m) const { return q.data() + m * Kp; }
  const int8_t* rest(int64_t m) const { return r.data() + m * Kp; }
  const float* chunk_scales(int64_t m, int64_t c) const { return lanes.data() + (m * (Kp / kChunk) + c) * 16; }
  float block_scale(int64_t m, int64_t b) const { return chunk_scales(m, b / 2)[(b % 2) * 8]; }
};

// x (bf16 rows, ldx apart) per block of 32: q = rne(x * inv) with inv = 127 / amax, then the rest x - q * amax / 127
// as r = rne(rest * 16 inv) in -8..8, so x^ = (16 q + r) * scale with scale = amax / (127 * 16) (rne: round to
// nearest even; the block's 32 values as two vectors of 16, the tail masked)
inline void prepare(Act& a, const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t G) {
  a.M = M, a.K = K, a.G = G, a.source = x, a.ldx = ldx;
  a.Kp = (K + kChunk - 1) / kChunk * kChunk;
  a.q.assign(M * a.Kp, 0);
  a.r.assign(M * a.Kp, 0);
  a.lanes.assign(M * a.Kp / kChunk * 16, 0.0f);
  a.sums.assign(M * G, 0.0f);
  const int64_t g = K / G;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      const int64_t n = std::min(K - k0, kBlock);
      const __mmask16 mask[2] = {static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1),
                                 static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0)};
      __m512 v[2];
      for (int h = 0; h < 2; ++h)  // bf16 -> fp32: the bits shifted up (exact)
        v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(mask[h], x + m * ldx + k0 + 16 * h)), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, step = amax / 127.0f, scale = step / 16.0f;
      __m512i total = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)), kRound);
        const __m512 rest = _mm512_sub_ps(v[h], _mm512_mul_ps(q, _mm512_set1_ps(step)));
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(inv * 16.0f)), kRound);
        const __m512i qi = _mm512_cvtps_epi32(q), ri = _mm512_cvtps_epi32(r);  // exact: whole numbers
        _mm_mask_storeu_epi8(a.q.data() + m * a.Kp + k0 + 16 * h, mask[h], _mm512_cvtepi32_epi8(qi));
        _mm_mask_storeu_epi8(a.r.data() + m * a.Kp + k0 + 16 * h, mask[h], _mm512_cvtepi32_epi8(ri));
        total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(qi, 4), ri));
      }
      float* lanes = a.lanes.data() + (m * (a.Kp / kChunk) + k0 / kChunk) * 16 + (k0 % kChunk) / kBlock * 8;
      std::fill(lanes, lanes + 8, scale);
      // blocks nest in groups (int4: g % 32 == 0); masked lanes are 0 (loads zeroed them)
      a.sums[m * G + k0 / g] += static_cast<float>(_mm512_reduce_add_epi32(total)) * scale;
    }
}

}  // namespace offload_native
