// int_cpu.cpp's inner kernels and input quantization with AVX512-VNNI and VBMI (VPDPBUSD, VPERMT2B): int_cpu.cpp's
// header says what they compute.
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
constexpr int64_t kInt4BlockRows = 64;  // torch's CPU int4 pack where its kernel runs AVX-512 (cpu_int.int4_block_rows)

// x (bf16 rows, ldx apart) per block of 32: q = rne(x * inv) with inv = 127 / amax, then the rest x - q * amax / 127
// as r = rne(rest * 16 inv) in -8..8, so x^ = (16 q + r) * scale with scale = amax / (127 * 16) (rne: round to
// nearest even; the block's 32 values as two vectors of 16, the tail masked)
inline void prepare(Act& a, const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t G) {
  a.reset(x, ldx, M, K, G, false);
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
      a.record(m, k0, scale, _mm512_reduce_add_epi32(total));  // masked lanes are 0 (the loads zeroed them)
    }
}

// ---- int8: NB weight rows at a time (independent chains), MB rows of x per pass -------------------------------
template <int NB, int MB>
void int8_rows(const Form& f, const Act& a, int64_t m0, int64_t n, bf16* out, int64_t ldo) {
  __m512 acc[NB][MB];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  const int64_t K = f.K;
  const int8_t* w = f.q8 + n * K;
  // the rows kPrefetchTiles tiles ahead (this task's next rows: they follow these in memory), one line per row per
  // step: a tile is NB short streams the hardware prefetcher does not ramp up on (as in bf16_cpu.cpp's dot_tile)
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchTiles * NB * K);
  for (int64_t k = 0; k < K; k += kChunk) {
    const int64_t c = k / kChunk;
    const __mmask64 mask = K - k >= kChunk ? ~0ull : (1ull << (K - k)) - 1;  // past K: q + 128 times x's 0
    __m512i xq[MB], xr[MB];
    __m512 xs[MB];
    for (int m = 0; m < MB; ++m) {
      xq[m] = _mm512_loadu_si512(a.row(m0 + m) + k);
      xr[m] = _mm512_loadu_si512(a.rest(m0 + m) + k);
      xs[m] = _mm512_loadu_ps(a.chunk_scales(m0 + m, c));
    }
    for (int r = 0; r < NB; ++r) {
      _mm_prefetch(ahead + (k / kChunk * NB + r) * 64, _MM_HINT_T0);
      const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + r * K + k), flip);
      for (int m = 0; m < MB; ++m) {  // 16 dot(w, q) + dot(w, r): exact, below 2^24
        const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(zero, wv, xq[m]), 4),
                                           _mm512_dpbusd_epi32(zero, wv, xr[m]));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xs[m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r) {
    const float s = to_float(f.s[n + r]), t = f.t != nullptr ? to_float(f.t[n + r]) : 0.0f;
    for (int m = 0; m < MB; ++m) {
      const float sum = a.sums[(m0 + m) * a.G];
      out[(m0 + m) * ldo + n + r] = to_bf16(s * (_mm512_reduce_add_ps(acc[r][m]) - 128.0f * sum) - sum * t);
    }
  }
}

// ---- int4: a 64-row block of the pack (32 bytes a k: byte i = row i low, row i + 32 high) ---------------------
// Vectors v of a block: 0 = rows 0-15 (low nibbles of bytes 0-15), 1 = rows 16-31, 2 = rows 32-47, 3 = rows 48-63.
inline void scale_zero(const Form& f, int64_t group, int64_t row, __mmask16 mask, __m512& s, __m512& z) {
  const int* pairs = reinterpret_cast<const int*>(f.s + group * f.N * 2);  // one (scale, zero) pair per row
  const __m512i v = _mm512_maskz_loadu_epi32(mask, pairs + row);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// rows [r0, r0 + rows) of the projection for row m of x, from a block's bytes (base: byte (k, i) at base[32 k + i]).
// One row of x per pass: its 8 integer accumulators, 4 group sums and 4 totals fill the registers (a second row's
// pass reads the block again from cache).
inline void int4_block(const Form& f, const Act& a, int64_t m, const uint8_t* base, int64_t r0, int rows, bf16* out,
                int64_t ldo) {
  alignas(64) static const struct Index {  // byte 4 i + t of lane i: byte i (or 16 + i) of k + t, of 4 k's bytes
    uint8_t first[64], second[64];
    Index() {
      for (int i = 0; i < 16; ++i)
        for (int t = 0; t < 4; ++t) first[4 * i + t] = 32 * t + i, second[4 * i + t] = 32 * t + 16 + i;
    }
  } index;
  const __m512i first = _mm512_load_si512(index.first), second = _mm512_load_si512(index.second);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __mmask16 mask[4];
  for (int v = 0; v < 4; ++v) mask[v] = static_cast<__mmask16>((1u << std::clamp(rows - 16 * v, 0, 16)) - 1);
  __m512 tot[4];
  for (int v = 0; v < 4; ++v) tot[v] = _mm512_setzero_ps();
  const int8_t *xq_row = a.row(m), *xr_row = a.rest(m);
  const int64_t g = f.K / f.G;
  for (int64_t group = 0; group < f.G; ++group) {
    // this block's (scale, zero) pairs of a later group: 256 bytes every N * 4, a stride no prefetcher follows
    const char* pairs = reinterpret_cast<const char*>(f.s + ((group + kPrefetchGroups) * f.N + r0) * 2);
    for (int line = 0; line < 4; ++line) _mm_prefetch(pairs + 64 * line, _MM_HINT_T0);
    __m512 gsum[4];
    for (int v = 0; v < 4; ++v) gsum[v] = _mm512_setzero_ps();
    for (int64_t k0 = group * g; k0 < (group + 1) * g; k0 += kBlock) {
      // per vector pair j (rows 16 j.., and rows 32 + 16 j.. in the high nibbles): the low nibbles' products with
      // x's two digits, and the whole bytes' (low + 16 high): the high nibbles' are the difference
      __m512i low_q[2], low_r[2], byte_q[2], byte_r[2];
      for (int j = 0; j < 2; ++j) low_q[j] = low_r[j] = byte_q[j] = byte_r[j] = _mm512_setzero_si512();
      for (int64_t k = k0; k < k0 + kBlock; k += 4) {
        const uint8_t* p = base + 32 * k;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);  // (hints never fault)
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64), _MM_HINT_T0);
        const __m512i lo = _mm512_loadu_si512(p), hi = _mm512_loadu_si512(p + 64);
        const __m512i bytes[2] = {_mm512_permutex2var_epi8(lo, first, hi), _mm512_permutex2var_epi8(lo, second, hi)};
        int32_t four_q, four_r;
        std::memcpy(&four_q, xq_row + k, sizeof four_q);
        std::memcpy(&four_r, xr_row + k, sizeof four_r);
        const __m512i xq = _mm512_set1_epi32(four_q), xr = _mm512_set1_epi32(four_r);
        for (int j = 0; j < 2; ++j) {
          const __m512i low = _mm512_and_si512(bytes[j], nibble);
          low_q[j] = _mm512_dpbusd_epi32(low_q[j], low, xq);
          low_r[j] = _mm512_dpbusd_epi32(low_r[j], low, xr);
          byte_q[j] = _mm512_dpbusd_epi32(byte_q[j], bytes[j], xq);
          byte_r[j] = _mm512_dpbusd_epi32(byte_r[j], bytes[j], xr);
        }
      }
      // sum q (16 xq + xr) exactly: low 16 low_q + low_r; high (byte_q - low_q) + (byte_r - low_r) / 16 (the
      // difference is 16 x the high nibbles' products, so the shift is exact); each below 2^24
      const __m512 sx = _mm512_set1_ps(a.block_scale(m, k0 / kBlock));
      for (int j = 0; j < 2; ++j) {
        const __m512i low = _mm512_add_epi32(_mm512_slli_epi32(low_q[j], 4), low_r[j]);
        const __m512i high = _mm512_add_epi32(_mm512_sub_epi32(byte_q[j], low_q[j]),
                                              _mm512_srai_epi32(_mm512_sub_epi32(byte_r[j], low_r[j]), 4));
        gsum[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), sx, gsum[j]);
        gsum[j + 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), sx, gsum[j + 2]);
      }
    }
    const __m512 sum = _mm512_set1_ps(a.sums[m * a.G + group]);
    for (int v = 0; v < 4; ++v) {
      __m512 s, z;
      scale_zero(f, group, r0 + 16 * v, mask[v], s, z);
      const __m512 term = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);  // z - 8 s: the nibbles' offset
      tot[v] = _mm512_fmadd_ps(term, sum, _mm512_fmadd_ps(gsum[v], s, tot[v]));
    }
  }
  alignas(64) float y[16];
  for (int v = 0; v < 4; ++v) {
    _mm512_store_ps(y, tot[v]);
    bf16* row = out + m * ldo + r0 + 16 * v;
    for (int j = 0; j < 16 && 16 * v + j < rows; ++j) row[j] = to_bf16(y[j]);
  }
}

}  // namespace offload_native
