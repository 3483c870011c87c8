// Q4_0 and Q8_0, the two block types llama.cpp users have most, with AVX512-VNNI: gguf_cpu.cpp's general path
// widens each 32 weights to int16 for VPMADDWD (~13 vector ops per 32 weights and row, compute-bound at ~10 GB/s a
// thread where the memory gives ~30 to two); here two blocks' 64 weights stay bytes and meet x's two int8 digits in
// two VPDPBUSD (~8 ops per 32), as int_avx512.h's int8 kernel does.
//
// VPDPBUSD multiplies unsigned weight bytes u by signed digits: Q4_0's nibbles are u = q + 8 already, Q8_0's bytes
// are flipped to u = q + 128 (one XOR). The o * sum(x^) this adds (o = 8 or 128) is taken off at the start of the
// rest digit's sum: each lane starts at -o * (16 sum q + sum r) of its 4 inputs (offsets(), once per call and row of
// x), so a lane holds 16 dot(u - o, q) + dot(u - o, r) = the 4 products with x's joined digits, exact in int32 and
// in float (|.| <= 4 * 128 * 2040 < 2^24). Lanes 0-7 are the chunk's first block, 8-15 its second: each lane is
// scaled by its block's d times x's block scale (Act::chunk_scales) and summed in fp32; the 16 lanes are reduced
// once, in a fixed order, and rounded to bf16.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_util.h"
#include "gguf_blocks.h"
#include "int_input.h"

namespace offload_native::gguf {

// a tile's NB rows are NB short streams the hardware prefetcher does not ramp up on: the rows kAheadTiles tiles
// ahead are prefetched into L2 as these are read (into L1, or 4 tiles ahead, two threads read the 30B shape's Q4_0
// head at ~20 GB/s; so, 26-29 of the machine's ~32: docs/PERF.md "Real size")
constexpr int64_t kAheadTiles = 8;

template <bool kQ8>
struct Fast {
  static constexpr int64_t kBytes = kQ8 ? 34 : 18;  // a block of 32
  static constexpr int kOffset = kQ8 ? 128 : 8;  // u - q
};

// -o * each lane's sum of 16 q + r, per chunk of 64 of row m of x: [Kp / 64][16] into out
inline void offsets(const Act& a, int64_t m, int o, int32_t* out) {
  const __m512i ones = _mm512_set1_epi8(static_cast<char>(o)), zero = _mm512_setzero_si512();  // o as unsigned
  for (int64_t k = 0; k < a.Kp; k += kChunk) {
    const __m512i sq = _mm512_dpbusd_epi32(zero, ones, _mm512_loadu_si512(a.row(m) + k));
    const __m512i sr = _mm512_dpbusd_epi32(zero, ones, _mm512_loadu_si512(a.rest(m) + k));
    _mm512_storeu_si512(out + k / kChunk * 16, _mm512_sub_epi32(zero, _mm512_add_epi32(_mm512_slli_epi32(sq, 4), sr)));
  }
}

// 64 weights of row p (blocks b and b + 1 at p, p + kBytes; second: block b + 1 exists) as unsigned bytes u
template <bool kQ8>
inline __m512i weight_bytes(const uint8_t* p, bool second) {
  if constexpr (kQ8) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m256i hi = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 36)) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    // [b's 16 bytes twice, b + 1's twice], the second copy of each shifted down 4: low nibbles are values 0-15 of a
    // block, high nibbles 16-31
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)));
    v = second ? _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 20)))
               : _mm512_maskz_mov_epi32(0x00FF, v);
    const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                            0x0004000400040004, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(0x0F));
  }
}

// the two blocks' scales d, one per lane (8 each; 0 where the second block does not exist)
template <bool kQ8>
inline __m512 weight_scales(const uint8_t* p, bool second) {
  uint16_t d0, d1 = 0;
  std::memcpy(&d0, p, 2);
  if (second) std::memcpy(&d1, p + Fast<kQ8>::kBytes, 2);
  const __m256i h = _mm256_mask_set1_epi16(_mm256_set1_epi16(static_cast<short>(d0)), 0xFF00, static_cast<short>(d1));
  return _mm512_cvtph_ps(h);
}

// NB output rows [n, n + NB) for MB rows of x (neg[m]: row m0 + m's offsets())
template <bool kQ8, int NB, int MB>
void fast_tile(const Form& f, const Act& a, const int32_t* const* neg, int64_t m0, int64_t n, bf16* out, int64_t ldo) {
  constexpr int64_t kB = Fast<kQ8>::kBytes;
  __m512 acc[NB][MB];
  const uint8_t* w[NB];
  for (int r = 0; r < NB; ++r) {
    w[r] = f.blocks + stored_row(f, n + r) * f.row_bytes;
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  const __m512i zero = _mm512_setzero_si512();
  const int64_t blocks = f.K / kBlock, chunks = (blocks + 1) / 2;
  const char* ahead = reinterpret_cast<const char*>(w[0] + kAheadTiles * NB * f.row_bytes);  // (hints never fault)
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t at = c * NB * 2 * kB; at < (c + 1) * NB * 2 * kB; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
    const bool second = 2 * c + 1 < blocks;
    __m512i xq[MB], xr[MB], xo[MB];
    __m512 xs[MB];
    for (int m = 0; m < MB; ++m) {
      xq[m] = _mm512_loadu_si512(a.row(m0 + m) + c * kChunk);
      xr[m] = _mm512_loadu_si512(a.rest(m0 + m) + c * kChunk);
      xo[m] = _mm512_loadu_si512(neg[m] + c * 16);
      xs[m] = _mm512_loadu_ps(a.chunk_scales(m0 + m, c));
    }
    for (int r = 0; r < NB; ++r) {
      const uint8_t* p = w[r] + 2 * c * kB;
      const __m512i u = weight_bytes<kQ8>(p, second);
      const __m512 d = weight_scales<kQ8>(p, second);
      for (int m = 0; m < MB; ++m) {
        const __m512i dq = _mm512_dpbusd_epi32(zero, u, xq[m]), dr = _mm512_dpbusd_epi32(xo[m], u, xr[m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(dq, 4), dr)),
                                    _mm512_mul_ps(d, xs[m]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[(m0 + m) * ldo + n + r] = to_bf16(_mm512_reduce_add_ps(acc[r][m]));
}

// ---- Q4_0, four blocks at a time -----------------------------------------------------------------------------
// A block's 16 bytes hold values 0-15 in their low nibbles and 16-31 in their high ones: four blocks' bytes side by
// side (one VPERMT2B from the 72 bytes they span) give 64 low nibbles and, shifted, 64 high ones, each multiplied
// with x laid out alike (Quads: x's values 0-15 of the four blocks, then 16-31); lane i's 8 products (4 low, 4 high)
// are all of block i / 4, whose scale one VPERMB gathers from the same bytes. ~4 vector ops per 32 weights.
struct Quads {  // row m of x per 4 blocks (g): the digits' low and high halves, offsets, scales (16 lanes each)
  std::vector<int8_t> q, r;  // [M][G4][2][64]: low half, high half
  std::vector<int32_t> neg;  // [M][G4][16]: -8 (16 sum q + sum r) of the lane's 8 inputs
  std::vector<float> s;  // [M][G4][16]: the lane's block's scale
  int64_t G4 = 0;
  void make(const Act& a) {
    G4 = a.K / (4 * kBlock);
    q.resize(a.M * G4 * 128), r.resize(a.M * G4 * 128), neg.resize(a.M * G4 * 16), s.resize(a.M * G4 * 16);
    const __m512i eights = _mm512_set1_epi8(8), zero = _mm512_setzero_si512();
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t g = 0; g < G4; ++g) {
        const int64_t at = (m * G4 + g) * 128;
        __m512i h[2][2];  // [digit][low / high]
        for (int d = 0; d < 2; ++d) {
          const int8_t* x = (d == 0 ? a.row(m) : a.rest(m)) + g * 128;
          const __m512i c0 = _mm512_loadu_si512(x), c1 = _mm512_loadu_si512(x + 64);
          h[d][0] = _mm512_shuffle_i64x2(c0, c1, _MM_SHUFFLE(2, 0, 2, 0));  // 128-bit lanes 0, 2 of each
          h[d][1] = _mm512_shuffle_i64x2(c0, c1, _MM_SHUFFLE(3, 1, 3, 1));
          _mm512_storeu_si512((d == 0 ? q.data() : r.data()) + at, h[d][0]);
          _mm512_storeu_si512((d == 0 ? q.data() : r.data()) + at + 64, h[d][1]);
        }
        const __m512i sq = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, eights, h[0][0]), eights, h[0][1]);
        const __m512i sr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, eights, h[1][0]), eights, h[1][1]);
        _mm512_storeu_si512(neg.data() + (m * G4 + g) * 16,
                            _mm512_sub_epi32(zero, _mm512_add_epi32(_mm512_slli_epi32(sq, 4), sr)));
        // chunk_scales(m, 2g) and (m, 2g + 1): 16 lanes each, a block's scale in lanes 0-7 and 8-15
        const __m512 s0 = _mm512_loadu_ps(a.chunk_scales(m, 2 * g)), s1 = _mm512_loadu_ps(a.chunk_scales(m, 2 * g + 1));
        const __m512 lanes = _mm512_permutex2var_ps(s0, _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0), s1);
        _mm512_storeu_ps(s.data() + (m * G4 + g) * 16, lanes);
      }
  }
};

template <int NB, int MB>
void q4_tile(const Form& f, const Quads& x, int64_t m0, int64_t n, bf16* out, int64_t ldo) {
  __m512 acc[NB][MB];
  const uint8_t* w[NB];
  for (int r = 0; r < NB; ++r) {
    w[r] = f.blocks + stored_row(f, n + r) * f.row_bytes;
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  // bytes of A = p[0..63], B = p[8..71]: the nibbles of blocks 0-2 from A, block 3's from B; the scales from A
  const __m512i nibbles = _mm512_set_epi8(
      127, 126, 125, 124, 123, 122, 121, 120, 119, 118, 117, 116, 115, 114, 113, 112,
      53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38,
      35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
      17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2);
  const __m512i scales = _mm512_set_epi8(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      55, 54, 55, 54, 55, 54, 55, 54, 37, 36, 37, 36, 37, 36, 37, 36,
      19, 18, 19, 18, 19, 18, 19, 18, 1, 0, 1, 0, 1, 0, 1, 0);
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const char* ahead = reinterpret_cast<const char*>(w[0] + kAheadTiles * NB * f.row_bytes);  // (hints never fault)
  for (int64_t g = 0; g < x.G4; ++g) {
    for (int64_t at = g * NB * 72; at < (g + 1) * NB * 72; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
    __m512i ql[MB], qh[MB], rl[MB], rh[MB], xo[MB];
    __m512 xs[MB];
    for (int m = 0; m < MB; ++m) {
      const int64_t at = ((m0 + m) * x.G4 + g);
      ql[m] = _mm512_loadu_si512(x.q.data() + at * 128), qh[m] = _mm512_loadu_si512(x.q.data() + at * 128 + 64);
      rl[m] = _mm512_loadu_si512(x.r.data() + at * 128), rh[m] = _mm512_loadu_si512(x.r.data() + at * 128 + 64);
      xo[m] = _mm512_loadu_si512(x.neg.data() + at * 16);
      xs[m] = _mm512_loadu_ps(x.s.data() + at * 16);
    }
    for (int r = 0; r < NB; ++r) {
      const uint8_t* p = w[r] + g * 72;
      const __m512i A = _mm512_loadu_si512(p), B = _mm512_loadu_si512(p + 8);
      const __m512i bytes = _mm512_permutex2var_epi8(A, nibbles, B);
      const __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(scales, A)));
      for (int m = 0; m < MB; ++m) {
        const __m512i dq = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, ql[m]), hi, qh[m]);
        const __m512i dr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(xo[m], lo, rl[m]), hi, rh[m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(dq, 4), dr)),
                                    _mm512_mul_ps(d, xs[m]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[(m0 + m) * ldo + n + r] = to_bf16(_mm512_reduce_add_ps(acc[r][m]));
}

inline void q4_rows(const Form& f, const Act& a, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  thread_local Quads x;
  x.make(a);
  for (int64_t m0 = 0; m0 < a.M; m0 += 2) {
    const bool two = a.M - m0 >= 2;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) two ? q4_tile<4, 2>(f, x, m0, n, out, ldo) : q4_tile<4, 1>(f, x, m0, n, out, ldo);
    for (; n < n1; ++n) two ? q4_tile<1, 2>(f, x, m0, n, out, ldo) : q4_tile<1, 1>(f, x, m0, n, out, ldo);
  }
}

// rows [n0, n1) of a Q4_0 / Q8_0 form for every row of x
template <bool kQ8>
void fast_rows(const Form& f, const Act& a, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  if (!kQ8 && f.K % (4 * kBlock) == 0) return q4_rows(f, a, n0, n1, out, ldo);
  thread_local std::vector<int32_t> offs;
  const int64_t per = a.Kp / kChunk * 16;
  offs.resize(a.M * per);
  std::vector<const int32_t*> neg(a.M);
  for (int64_t m = 0; m < a.M; ++m) {
    offsets(a, m, Fast<kQ8>::kOffset, offs.data() + m * per);
    neg[m] = offs.data() + m * per;
  }
  for (int64_t m0 = 0; m0 < a.M; m0 += 2) {
    const bool two = a.M - m0 >= 2;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4)
      two ? fast_tile<kQ8, 4, 2>(f, a, neg.data() + m0, m0, n, out, ldo)
          : fast_tile<kQ8, 4, 1>(f, a, neg.data() + m0, m0, n, out, ldo);
    for (; n < n1; ++n)
      two ? fast_tile<kQ8, 1, 2>(f, a, neg.data() + m0, m0, n, out, ldo)
          : fast_tile<kQ8, 1, 1>(f, a, neg.data() + m0, m0, n, out, ldo);
  }
}

}  // namespace offload_native::gguf
