// bfloat16 <-> float conversions shared by the native CPU kernels (bf16_cpu.cpp, int_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace offload_native {

using bf16 = uint16_t;

inline float to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// round to nearest even, NaN kept quiet: what torch's float -> bfloat16 does; no branch, so that loops over it
// vectorize (a select, not a jump)
inline bf16 to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16, quiet = (bits >> 16) | 0x40;
  return static_cast<bf16>((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// silu rounded as torch's bfloat16 F.silu rounds it, then times u rounded as its bfloat16 multiply does
inline bf16 silu_times(bf16 g, bf16 u) {
  float gv = to_float(g);
  float act = to_float(to_bf16(gv / (1.0f + std::exp(-gv))));
  return to_bf16(act * to_float(u));
}

// rows [0, M) of out (ldo apart), columns [a, b), times each row's routing weight (weight[m * step]), rounded as
// torch's bf16 multiply rounds it: an expert's part, its down projection rounded first
inline void weigh_rows(bf16* out, int64_t ldo, int64_t M, const bf16* weight, int64_t step, int64_t a, int64_t b) {
  for (int64_t m = 0; m < M; ++m) {
    const float w = to_float(weight[m * step]);
    bf16* row = out + m * ldo;
    for (int64_t j = a; j < b; ++j) row[j] = to_bf16(to_float(row[j]) * w);
  }
}

}  // namespace offload_native
