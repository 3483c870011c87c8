// Q4_K (llama.cpp's Q4_K_M files are mostly this type) with AVX512-VNNI, as gguf_avx512.h does Q4_0: the general
// path widens each 32 weights to int16 (~13 vector ops per 32 and row, ~12 GB/s on two threads, compute-bound);
// here a super-block's 128 bytes of nibbles stay bytes and meet x's two int8 digits in VPDPBUSD (~6 ops per 32).
//
// A super-block (256 values, 144 bytes): fp16 d and dmin, 12 bytes of 6-bit scales sc_j and mins m_j for its eight
// 32s, then 4 x 32 bytes of nibbles: bytes 32c..32c+31 hold 32 j = 2c in their low nibbles and j = 2c + 1 in their
// high ones; w = d sc_j q - dmin m_j. Its 128 bytes as two 64-byte vectors give four of 64 nibbles (low / high of
// each), lanes 0-7 one 32 and 8-15 another ([0 | 2], [1 | 3], [4 | 6], [5 | 7]), each multiplied with x's digits
// laid out alike (KSupers) from zero: no two 32s share a lane, so each lane's 16 dot(q, x_q) + dot(q, x_r) is
// exact (|.| <= 4 * 15 * 2040) and scaled by its 32's d sc_j times x's block scale. The mins' term takes each
// 32's sum of x^ (Act::sums): -dmin sum_j m_j S_j, 8 lanes. Both reduced once per output in a fixed order.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_util.h"
#include "gguf_avx512.h"
#include "gguf_blocks.h"
#include "int_input.h"

namespace offload_native::gguf {

struct KSupers {  // row m of x per super-block: digits and scales in the nibble vectors' order, the 32s' sums
  static constexpr int64_t kBytes = 4 * 64, kLanes = 4 * 16;
  std::vector<int8_t> q, r;  // [M][S][4][64]
  std::vector<float> s;  // [M][S][4][16]
  std::vector<float> sums;  // [M][S][8]
  int64_t S = 0;
  void make(const Act& a) {
    S = a.K / 256;
    q.resize(a.M * S * kBytes), r.resize(a.M * S * kBytes), s.resize(a.M * S * kLanes), sums.resize(a.M * S * 8);
    // [c0 | c1] 256-bit halves: the four vectors' x ([0 | 2], [1 | 3], [4 | 6], [5 | 7]) from chunks c0..c3
    const __m512i take_lo = _mm512_set_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i take_hi = _mm512_set_epi32(24, 24, 24, 24, 24, 24, 24, 24, 8, 8, 8, 8, 8, 8, 8, 8);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t sb = 0; sb < S; ++sb) {
        const int64_t at = m * S + sb;
        for (int d = 0; d < 2; ++d) {
          const int8_t* x = (d == 0 ? a.row(m) : a.rest(m)) + sb * 256;
          int8_t* out = (d == 0 ? q.data() : r.data()) + at * kBytes;
          for (int h = 0; h < 2; ++h) {  // chunks 2h, 2h + 1
            const __m512i c0 = _mm512_loadu_si512(x + 128 * h), c1 = _mm512_loadu_si512(x + 128 * h + 64);
            _mm512_storeu_si512(out + 128 * h, _mm512_shuffle_i64x2(c0, c1, _MM_SHUFFLE(1, 0, 1, 0)));
            _mm512_storeu_si512(out + 128 * h + 64, _mm512_shuffle_i64x2(c0, c1, _MM_SHUFFLE(3, 2, 3, 2)));
          }
        }
        for (int h = 0; h < 2; ++h) {  // chunk_scales: 16 lanes, a block's scale in 0-7 and another's in 8-15
          const __m512 s0 = _mm512_loadu_ps(a.chunk_scales(m, sb * 4 + 2 * h));
          const __m512 s1 = _mm512_loadu_ps(a.chunk_scales(m, sb * 4 + 2 * h + 1));
          _mm512_storeu_ps(s.data() + at * kLanes + 32 * h, _mm512_permutex2var_ps(s0, take_lo, s1));
          _mm512_storeu_ps(s.data() + at * kLanes + 32 * h + 16, _mm512_permutex2var_ps(s0, take_hi, s1));
        }
        std::memcpy(sums.data() + at * 8, a.sums.data() + m * a.G + sb * 8, 8 * sizeof(float));
      }
  }
};

// the 8 scales and 8 mins of a super-block's 12 bytes (ggml's get_scale_min_k4, four at a time) as floats
inline void k_scales_mins(const uint8_t* p, __m256& sc, __m256& mn) {
  uint32_t u[4];
  std::memcpy(u, p, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t mins_lo = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = mins_lo;
  u[0] &= k1;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));  // bytes: sc 0-7, m 0-7
  sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}

template <int NB>
void q4k_tile(const Form& f, const KSupers& x, int64_t m, int64_t n, bf16* out, int64_t ldo) {
  constexpr int64_t kB = 144;
  __m512 acc[NB];
  __m256 off[NB];
  const uint8_t* w[NB];
  for (int r = 0; r < NB; ++r) {
    w[r] = f.blocks + stored_row(f, n + r) * f.row_bytes;
    acc[r] = _mm512_setzero_ps(), off[r] = _mm256_setzero_ps();
  }
  // which 32's scale each lane of the four products takes ([0 | 2], [1 | 3], [4 | 6], [5 | 7])
  const __m512i pick[4] = {_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                           _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
                           _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
                           _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const char* ahead = reinterpret_cast<const char*>(w[0] + kAheadTiles * NB * f.row_bytes);  // (hints never fault)
  for (int64_t sb = 0; sb < x.S; ++sb) {
    for (int64_t at = sb * NB * kB; at < (sb + 1) * NB * kB; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
    const int64_t xa = m * x.S + sb;
    const int8_t* xq = x.q.data() + xa * KSupers::kBytes;
    const int8_t* xr = x.r.data() + xa * KSupers::kBytes;
    const float* xs = x.s.data() + xa * KSupers::kLanes;
    const __m256 sums = _mm256_loadu_ps(x.sums.data() + xa * 8);
    for (int r = 0; r < NB; ++r) {
      const uint8_t* p = w[r] + sb * kB;
      __m256 sc, mn;
      k_scales_mins(p + 4, sc, mn);
      const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(half(p)), sc);
      off[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half(p + 2)), mn), sums, off[r]);
      const __m512 ds16 = _mm512_castps256_ps512(ds);
      for (int h = 0; h < 2; ++h) {
        const __m512i bytes = _mm512_loadu_si512(p + 16 + 64 * h);
        const __m512i nib[2] = {_mm512_and_si512(bytes, low), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low)};
        for (int i = 0; i < 2; ++i) {
          const int v = 2 * h + i;  // the product: [0 | 2], [1 | 3], [4 | 6], [5 | 7]
          const __m512i dq = _mm512_dpbusd_epi32(zero, nib[i], _mm512_loadu_si512(xq + 64 * v));
          const __m512i dr = _mm512_dpbusd_epi32(zero, nib[i], _mm512_loadu_si512(xr + 64 * v));
          const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(pick[v], ds16), _mm512_loadu_ps(xs + 16 * v));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(dq, 4), dr)), scale, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < NB; ++r) {
    __m128 o = _mm_add_ps(_mm256_castps256_ps128(off[r]), _mm256_extractf128_ps(off[r], 1));  // fixed order
    o = _mm_add_ps(o, _mm_movehl_ps(o, o));
    o = _mm_add_ss(o, _mm_movehdup_ps(o));
    out[m * ldo + n + r] = to_bf16(_mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(o));
  }
}

// rows [n0, n1) of a Q4_K form for every row of x
inline void q4k_rows(const Form& f, const Act& a, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  thread_local KSupers x;
  x.make(a);
  for (int64_t m = 0; m < a.M; ++m) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) q4k_tile<4>(f, x, m, n, out, ldo);
    for (; n < n1; ++n) q4k_tile<1>(f, x, m, n, out, ldo);
  }
}

}  // namespace offload_native::gguf
