// The input of int_cpu.cpp's kernels: a projection's bf16 rows quantized once per call, per block of 32 values, to
// two int8 digits (int_cpu.cpp's header says why and how they are multiplied).
#pragma once

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
// nearest even)
inline void prepare(Act& a, const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t G) {
  a.M = M, a.K = K, a.G = G, a.source = x, a.ldx = ldx;
  a.Kp = (K + kChunk - 1) / kChunk * kChunk;
  a.q.assign(M * a.Kp, 0);
  a.r.assign(M * a.Kp, 0);
  a.lanes.assign(M * a.Kp / kChunk * 16, 0.0f);
  a.sums.assign(M * G, 0.0f);
  const int64_t g = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      const int64_t k1 = std::min(K, k0 + kBlock);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(to_float(x[m * ldx + k])));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, step = amax / 127.0f, scale = step / 16.0f;
      int32_t qsum = 0;
      for (int64_t k = k0; k < k1; ++k) {
        const float v = to_float(x[m * ldx + k]);
        const float q = std::nearbyint(v * inv), r = std::nearbyint((v - q * step) * (inv * 16.0f));
        a.q[m * a.Kp + k] = static_cast<int8_t>(q);
        a.r[m * a.Kp + k] = static_cast<int8_t>(r);
        qsum += 16 * static_cast<int32_t>(q) + static_cast<int32_t>(r);
      }
      float* lanes = a.lanes.data() + (m * (a.Kp / kChunk) + k0 / kChunk) * 16 + (k0 % kChunk) / kBlock * 8;
      std::fill(lanes, lanes + 8, scale);
      a.sums[m * G + k0 / g] += static_cast<float>(qsum) * scale;  // blocks nest in groups (int4: g % 32 == 0)
    }
}

}  // namespace offload_native
