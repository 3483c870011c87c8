// int_cpu.cpp's inner kernels and input quantization with AVX2 (CPUs without AVX512-VNNI): the same input digits and
// the same exact integer sums within a block as int_avx512.h, formed with AVX2's multiplies (int_cpu.cpp's header
// says what they compute).
//   int8  VPMADDWD on 16-bit values: the weight sign-extended, x^'s digits joined (16 q + r, |.| <= 2040), so one
//         multiply takes both digits and the weight needs no offset: y = s * sum_blocks dot(q, x^) - S t
//   int4  the pack in torch's AVX2 layout (32-row blocks); VPMADDUBSW (unsigned nibble x signed digit, pairs
//         summed in 16 bits: at most 2 * 15 * 127), summed in 16 bits over a block, then VPMADDWD (x16 for q, x1
//         for r) into int32 once per block; four k's bytes are regrouped into one 32-bit lane per row (an unpack,
//         a permute and a shuffle: AVX2's VPERMT2B), and prepare stores x's q and r digits in that order.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_util.h"
#include "int_input.h"

namespace offload_native {

constexpr int64_t kPrefetchTiles = 8;  // int8: how many NB-row tiles ahead the weight rows are prefetched
constexpr int64_t kPrefetchBytes = 2048;  // int4: how far ahead in a block's one stream
constexpr int64_t kPrefetchGroups = 4;  // int4: how many groups ahead a block's scales are prefetched
constexpr int64_t kInt4BlockRows = 32;  // torch's CPU int4 pack where its kernel runs AVX2 (cpu_int.int4_block_rows)

inline float sum_lanes(__m256 v) {  // the 8 lanes in a fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x (bf16 rows, ldx apart) per block of 32, with int_avx512.h's arithmetic (the same digits, bit for bit): q =
// rne(x * inv), inv = 127 / amax; r = rne((x - q * step) * 16 inv), step = amax / 127; x^ = (16 q + r) * step / 16
inline void prepare(Act& a, const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t G) {
  a.reset(x, ldx, M, K, G, true);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      const int64_t n = std::min(K - k0, kBlock);
      alignas(32) bf16 block[kBlock] = {};
      std::memcpy(block, x + m * ldx + k0, n * sizeof(bf16));
      __m256 v[4];
      __m256 top = _mm256_setzero_ps();
      for (int h = 0; h < 4; ++h) {  // bf16 -> fp32: the bits shifted up (exact)
        const __m128i half = _mm_load_si128(reinterpret_cast<const __m128i*>(block + 8 * h));
        v[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        top = _mm256_max_ps(top, _mm256_and_ps(v[h], magnitude));
      }
      alignas(32) float lanes8[8];
      _mm256_store_ps(lanes8, top);
      const float amax = *std::max_element(lanes8, lanes8 + 8);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, step = amax / 127.0f, scale = step / 16.0f;
      alignas(32) int32_t qi[kBlock], ri[kBlock];
      for (int h = 0; h < 4; ++h) {
        const __m256 q = _mm256_round_ps(_mm256_mul_ps(v[h], _mm256_set1_ps(inv)), kRound);
        const __m256 rest = _mm256_sub_ps(v[h], _mm256_mul_ps(q, _mm256_set1_ps(step)));
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(rest, _mm256_set1_ps(inv * 16.0f)), kRound);
        _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * h), _mm256_cvtps_epi32(q));  // exact: whole numbers
        _mm256_store_si256(reinterpret_cast<__m256i*>(ri + 8 * h), _mm256_cvtps_epi32(r));
      }
      int32_t total = 0;  // past n: zeros (the copy was zero-filled)
      const int64_t at = m * a.Kp + k0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t swapped = i % 4 == 1 || i % 4 == 2 ? i ^ 3 : i;  // int4_block's order: (k, k+2, k+1, k+3)
        a.q[at + swapped] = static_cast<int8_t>(qi[i]);
        a.r[at + swapped] = static_cast<int8_t>(ri[i]);
        a.x16[at + i] = static_cast<int16_t>(16 * qi[i] + ri[i]);
        total += 16 * qi[i] + ri[i];
      }
      a.record(m, k0, scale, total);
    }
}

// ---- int8: NB weight rows at a time, MB <= 2 rows of x per pass (R x 2 accumulators and x's values fill the 16
// registers; more rows of x go two at a time: each output's sums are the same whatever rows share a pass) --------
template <int NB, int MB>
void int8_rows(const Form& f, const Act& a, int64_t m0, int64_t n, bf16* out, int64_t ldo) {
  if constexpr (MB > 2) {
    int8_rows<NB, 2>(f, a, m0, n, out, ldo);
    int8_rows<NB, MB - 2>(f, a, m0 + 2, n, out, ldo);
  } else {
    __m256 acc[NB][MB];
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const int64_t K = f.K;
    const int8_t* w = f.q8 + n * K;
    const char* ahead = reinterpret_cast<const char*>(w + kPrefetchTiles * NB * K);  // as int_avx512.h
    // one block of 32 k's at k, the NB rows' bytes at wk[r] (the last block: zero-padded copies)
    auto block = [&](const int8_t* const* wk, int64_t k) __attribute__((always_inline)) {
      __m256i xl[MB], xh[MB];
      __m256 xs[MB];
      for (int m = 0; m < MB; ++m) {
        xl[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.joined(m0 + m) + k));
        xh[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.joined(m0 + m) + k + 16));
        xs[m] = _mm256_set1_ps(a.block_scale(m0 + m, k / kBlock));
      }
      for (int r = 0; r < NB; ++r) {
        if (k % kChunk == 0) _mm_prefetch(ahead + (k / kChunk * NB + r) * 64, _MM_HINT_T0);
        const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk[r])));
        const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk[r] + 16)));
        for (int m = 0; m < MB; ++m) {  // exact: |sum| <= 32 * 128 * 2040 < 2^24
          const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(wl, xl[m]), _mm256_madd_epi16(wh, xh[m]));
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xs[m], acc[r][m]);
        }
      }
    };
    const int64_t full = K / kBlock * kBlock;
    const int8_t* wk[NB];
    for (int64_t k = 0; k < full; k += kBlock) {
      for (int r = 0; r < NB; ++r) wk[r] = w + r * K + k;
      block(wk, k);
    }
    if (full < K) {
      alignas(16) int8_t tail[NB][kBlock] = {};  // x's digits are 0 past K
      for (int r = 0; r < NB; ++r) {
        std::memcpy(tail[r], w + r * K + full, K - full);
        wk[r] = tail[r];
      }
      block(wk, full);
    }
    for (int r = 0; r < NB; ++r) {
      const float s = to_float(f.s[n + r]), t = f.t != nullptr ? to_float(f.t[n + r]) : 0.0f;
      for (int m = 0; m < MB; ++m) {
        const float sum = a.sums[(m0 + m) * a.G];
        out[(m0 + m) * ldo + n + r] = to_bf16(s * sum_lanes(acc[r][m]) - sum * t);
      }
    }
  }
}

// ---- int4: a 32-row block of the pack (torch's AVX2 layout: 16 bytes a k, byte i = row i low, row i + 16 high) --
// Four k's bytes become one 32-bit lane per byte i, in the order (k, k + 2, k + 1, k + 3) (a byte unpack of k, k + 1
// against k + 2, k + 3, then a qword permute and a byte shuffle to pair each row's halves): vector 2 j + h holds
// in lane l the row row_of(j, h, l), bytes 8 j + l, low nibbles (h = 0) or high ones (h = 1, 16 rows on); x's
// four digits are stored in the same order (prepare).
constexpr int row_of(int j, int h, int l) { return 8 * j + l + 16 * h; }

// rows [r0, r0 + rows) of the projection for row m of x, from a block's bytes (base: byte (k, i) at base[16 k + i])
inline void int4_block(const Form& f, const Act& a, int64_t m, const uint8_t* base, int64_t r0, int rows, bf16* out,
                       int64_t ldo) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi16(16), one = _mm256_set1_epi16(1);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i pairs_of_rows = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                                 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  __m256 tot[4], gsum[4];
  for (int v = 0; v < 4; ++v) tot[v] = _mm256_setzero_ps();
  const int8_t *xq_row = a.row(m), *xr_row = a.rest(m);
  const int64_t g = f.K / f.G;
  alignas(32) int32_t padded[32];  // a tail block's (scale, zero) pairs, rows past N zero
  for (int64_t group = 0; group < f.G; ++group) {
    // this block's (scale, zero) pairs of a later group: 128 bytes every N * 4, a stride no prefetcher follows
    const char* later = reinterpret_cast<const char*>(f.s + ((group + kPrefetchGroups) * f.N + r0) * 2);
    for (int line = 0; line < 2; ++line) _mm_prefetch(later + 64 * line, _MM_HINT_T0);
    for (int v = 0; v < 4; ++v) gsum[v] = _mm256_setzero_ps();
    for (int64_t k0 = group * g; k0 < (group + 1) * g; k0 += kBlock) {
      // a block's products summed in 16 bits, exactly: each maddubs lane is two products of one row, at most
      // 2 * 15 * 127 = 3810 for q (8 steps: 30480 < 2^15) and 2 * 15 * 8 for r; widened once per block
      __m256i acc_q[4], acc_r[4];
      for (int v = 0; v < 4; ++v) acc_q[v] = acc_r[v] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + kBlock; k += 4) {
        const uint8_t* p = base + 16 * k;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);  // (hints never fault)
        const __m256i b01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i b23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
        const __m256i mixed[2] = {_mm256_unpacklo_epi8(b01, b23), _mm256_unpackhi_epi8(b01, b23)};
        int32_t four_q, four_r;  // x's digits at k..k+3, stored by prepare in the lanes' order
        std::memcpy(&four_q, xq_row + k, sizeof four_q);
        std::memcpy(&four_r, xr_row + k, sizeof four_r);
        const __m256i xq = _mm256_set1_epi32(four_q), xr = _mm256_set1_epi32(four_r);
        for (int j = 0; j < 2; ++j) {
          const __m256i quad = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(mixed[j], 0xD8), pairs_of_rows);
          const __m256i nibbles[2] = {_mm256_and_si256(quad, nibble),
                                      _mm256_and_si256(_mm256_srli_epi16(quad, 4), nibble)};
          for (int h = 0; h < 2; ++h) {
            acc_q[2 * j + h] = _mm256_add_epi16(acc_q[2 * j + h], _mm256_maddubs_epi16(nibbles[h], xq));
            acc_r[2 * j + h] = _mm256_add_epi16(acc_r[2 * j + h], _mm256_maddubs_epi16(nibbles[h], xr));
          }
        }
      }
      const __m256 sx = _mm256_set1_ps(a.block_scale(m, k0 / kBlock));
      for (int v = 0; v < 4; ++v) {  // 16 dot(q) + dot(r) over the block, one int32 per row (a lane's two halves)
        const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(acc_q[v], sixteen), _mm256_madd_epi16(acc_r[v], one));
        gsum[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sx, gsum[v]);
      }
    }
    const int32_t* pairs = reinterpret_cast<const int32_t*>(f.s + group * f.N * 2) + r0;  // (scale, zero) per row
    if (rows < 32) {
      std::fill(padded, padded + 32, 0);
      std::copy(pairs, pairs + rows, padded);
      pairs = padded;
    }
    const __m256 sum = _mm256_set1_ps(a.sums[m * a.G + group]);
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) {
        const int v = 2 * j + h;
        const __m256i sz = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + row_of(j, h, 0)));
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
        const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(sz, high_half));
        const __m256 term = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z);  // z - 8 s: the nibbles' offset
        tot[v] = _mm256_fmadd_ps(term, sum, _mm256_fmadd_ps(gsum[v], s, tot[v]));
      }
  }
  alignas(32) float y[8];
  bf16* row = out + m * ldo + r0;
  for (int j = 0; j < 2; ++j)
    for (int h = 0; h < 2; ++h) {
      _mm256_store_ps(y, tot[2 * j + h]);
      for (int l = 0; l < 8; ++l)
        if (row_of(j, h, l) < rows) row[row_of(j, h, l)] = to_bf16(y[l]);
    }
}

}  // namespace offload_native
