// The inputs of int_cpu.cpp's kernels: a projection's bf16 rows quantized once per call, per block of 32 values, to
// two int8 digits (int_cpu.cpp's header says why and how they are multiplied; int_avx512.h / int_avx2.h make
// them), and a weight's kernel form.
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
  //   (AVX2: each 4 k's in the order k, k + 2, k + 1, k + 3: int_avx2.h's int4 lanes)
  std::vector<int16_t> x16;  // [M, Kp]: 16 q + r (the AVX2 int8 kernel multiplies it with VPMADDWD; else empty)
  std::vector<float> lanes;  // [M, Kp / kChunk, 16]: each chunk's two block scales, one per VPDPBUSD lane
  std::vector<float> sums;  // [M, G]
  int64_t M = 0, K = 0, Kp = 0, G = 1;
  const void* source = nullptr;  // the bf16 rows it was made from (experts routed the same x share it)
  int64_t ldx = 0;
  const int8_t* row(int64_t m) const { return q.data() + m * Kp; }
  const int8_t* rest(int64_t m) const { return r.data() + m * Kp; }
  const int16_t* joined(int64_t m) const { return x16.data() + m * Kp; }
  const float* chunk_scales(int64_t m, int64_t c) const { return lanes.data() + (m * (Kp / kChunk) + c) * 16; }
  float block_scale(int64_t m, int64_t b) const { return chunk_scales(m, b / 2)[(b % 2) * 8]; }

  // sized and zeroed for M rows of K inputs in G groups, made from x (ldx apart); with_joined: x16 too
  void reset(const void* x, int64_t ldx_, int64_t M_, int64_t K_, int64_t G_, bool with_joined) {
    M = M_, K = K_, G = G_, source = x, ldx = ldx_;
    Kp = (K + kChunk - 1) / kChunk * kChunk;
    q.assign(M * Kp, 0);
    r.assign(M * Kp, 0);
    x16.assign(with_joined ? M * Kp : 0, 0);
    lanes.assign(M * Kp / kChunk * 16, 0.0f);
    sums.assign(M * G, 0.0f);
  }

  // the block of row m starting at k0: its scale (the 8 lanes of its half of the chunk), and its sum of x^ (total:
  // the sum of its 16 q + r) added to its group's (blocks nest in groups: int4's g % 32 == 0)
  void record(int64_t m, int64_t k0, float scale, int32_t total) {
    float* at = lanes.data() + (m * (Kp / kChunk) + k0 / kChunk) * 16 + (k0 % kChunk) / kBlock * 8;
    std::fill(at, at + 8, scale);
    sums[m * G + k0 / (K / G)] += static_cast<float>(total) * scale;
  }
};

struct Form {  // one projection's weight in its kernel form
  bool int4 = false;
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const bf16* s = nullptr;  // int8: [N]; int4: [G, N, 2] (scale, zero) pairs
  const bf16* t = nullptr;  // int8: zero term [N] or null
  int64_t N = 0, K = 0, G = 1;  // G: groups of K (int4), 1 (int8)
  // a GGUF block type read in place (gguf_cpu.cpp): its ggml type id (0: int8 / int4 above), the blocks of row n
  // at blocks + src(n) * row_bytes, src undoing llama.cpp's q/k row permutation where heads > 0
  int gguf = 0;
  const uint8_t* blocks = nullptr;
  int64_t row_bytes = 0, heads = 0;
};

}  // namespace offload_native
