// The GGUF block types gguf_cpu.cpp multiplies in place: each type's blocks decoded, 32 weights at a time, to the
// integers the block holds (int16, in the values' own order) and the float scale(s) they are multiplied by, as
// ggml defines them (runtime/gguf_dequant.py's decoders; the tests compare with the `gguf` package's):
//   Q8_0    34 bytes / 32:  fp16 d, 32 int8 q                          w = d * q
//   Q4_0    18 bytes / 32:  fp16 d, 16 bytes (low nibbles 0..15)       w = d * (q - 8)
//   Q4_K   144 bytes / 256: fp16 d, dmin, 12 bytes of 6-bit sc / m, 128 bytes of nibbles
//                                                                      w = (d sc) * q - dmin m  (per 32)
//   Q5_K   176 bytes / 256: Q4_K's and 32 bytes of fifth bits          w = (d sc) * q - dmin m  (q 0..31)
//   Q6_K   210 bytes / 256: 128 low nibbles, 64 bytes of 2 high bits, 16 int8 sc, fp16 d
//                                                                      w = (d sc) * (q - 32)    (per 16)
//   IQ4_XS 136 bytes / 256: fp16 d, 8 six-bit scales, nibbles indexing a 16-value table
//                                                                      w = (d (ls - 32)) * table[q]
//   MXFP4   17 bytes / 32:  e8m0 e, 16 bytes of e2m1 codes             w = 2^(e-128) * (2 e2m1[q])
// Every type's integer part fits int16 (|q| <= 127), so a block's dot with x's joined digits (16 q + r, |.| <=
// 2040: int_input.h) is VPMADDWD's, exact in int32 and in float (< 2^24); a K-quant's offset term (dmin m) takes
// the block's sum of x^ instead (Act::sums, one group per 32 inputs). Only AVX2 / F16C instructions: the AVX-512
// build uses them too (gguf_cpu.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int_input.h"

namespace offload_native::gguf {

// ggml's type ids (gguf.GGMLQuantizationType), the form's meta[0] (runtime/gguf_dequant.NATIVE_TYPES)
enum Type : int { kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_XS = 23, kMXFP4 = 39 };

// the stored row of output row n: llama.cpp's converter interleaves each head's rope pairs in q / k
// (gguf_dequant.unpermute undoes it on a dequantized weight)
inline int64_t stored_row(const Form& f, int64_t n) {
  if (f.heads == 0) return n;
  const int64_t per = f.N / f.heads, half = per / 2, rem = n % per;
  return n - rem + 2 * (rem % half) + rem / half;
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }

// 32 signed bytes -> the two int16 halves (values 0..15, 16..31)
inline void widen(__m256i v, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
  hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

// One sub-block of 32 weights: the int16 values (lo: 0..15, hi: 16..31), the scale of each half (equal but for
// Q6_K), and the offset term's coefficient (the weight's constant part: w = s * q + off; 0 but for Q4_K / Q5_K)
struct Sub {
  __m256i lo, hi;
  float s_lo, s_hi, off;
};

// A block's scales decoded once (open), for each of its 32s (a block of 32: the one scale)
struct Scales {
  float s[8], off[8];
};
struct Scale {
  float d;
};

// Each type: kValues per block, kBytes per block, kSplit (two scales per 32), kOffset (an offset term); open(p)
// decodes the block's scales, sub(p, head, j) its j-th 32 (j < kValues / 32).
struct Q8_0 {
  static constexpr int kValues = 32, kBytes = 34;
  static constexpr bool kSplit = false, kOffset = false;
  using Head = Scale;
  static Head open(const uint8_t* p) { return {half(p)}; }
  static Sub sub(const uint8_t* p, const Head& h, int) {
    Sub s;
    s.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)));
    s.hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)));
    s.s_lo = s.s_hi = h.d, s.off = 0.0f;
    return s;
  }
};

struct Q4_0 {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSplit = false, kOffset = false;
  using Head = Scale;
  static Head open(const uint8_t* p) { return {half(p)}; }
  static Sub sub(const uint8_t* p, const Head& h, int) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)), eight = _mm_set1_epi8(8);
    Sub s;
    s.lo = _mm256_cvtepi8_epi16(_mm_sub_epi8(low_nibbles(raw), eight));
    s.hi = _mm256_cvtepi8_epi16(_mm_sub_epi8(high_nibbles(raw), eight));
    s.s_lo = s.s_hi = h.d, s.off = 0.0f;
    return s;
  }
};

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a K-quant's 12 bytes
inline void scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63, m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: each 32's scale d * sc and offset -(dmin * m)
inline Scales k_scales(const uint8_t* p) {
  Scales h;
  const float d = half(p), dmin = half(p + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min(p + 4, j, sc, m);
    h.s[j] = d * static_cast<float>(sc), h.off[j] = -(dmin * static_cast<float>(m));
  }
  return h;
}

struct Q4_K {
  static constexpr int kValues = 256, kBytes = 144;
  static constexpr bool kSplit = false, kOffset = true;
  using Head = Scales;
  static Head open(const uint8_t* p) { return k_scales(p); }
  static Sub sub(const uint8_t* p, const Head& h, int j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * (j / 2)));
    Sub s;
    widen(j % 2 ? high_nibbles(raw) : low_nibbles(raw), s.lo, s.hi);
    s.s_lo = s.s_hi = h.s[j], s.off = h.off[j];
    return s;
  }
};

struct Q5_K {
  static constexpr int kValues = 256, kBytes = 176;
  static constexpr bool kSplit = false, kOffset = true;
  using Head = Scales;
  static Head open(const uint8_t* p) { return k_scales(p); }
  static Sub sub(const uint8_t* p, const Head& h, int j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 48 + 32 * (j / 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    // bit j of each byte (a 16-bit shift: the other byte's bits land above bit 0, masked off) as 16
    const __m256i fifth = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                                             _mm256_set1_epi8(1)), 4);
    Sub s;
    widen(_mm256_or_si256(j % 2 ? high_nibbles(raw) : low_nibbles(raw), fifth), s.lo, s.hi);
    s.s_lo = s.s_hi = h.s[j], s.off = h.off[j];
    return s;
  }
};

struct Q6_K {
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kSplit = true, kOffset = false;
  using Head = Scale;
  static Head open(const uint8_t* p) { return {half(p + 208)}; }
  // sub-block j = 4 g + 2 h + c: nibble h of ql[64 g + 32 c + i], bits 2 (2 h + c) of qh[32 g + i]
  static Sub sub(const uint8_t* p, const Head& hd, int j) {
    const int g = j / 4, h = (j / 2) % 2, c = j % 2;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g + 32 * c));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * g));
    const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * (2 * h + c))),
                                                           _mm256_set1_epi8(3)), 4);
    Sub s;
    widen(_mm256_sub_epi8(_mm256_or_si256(h ? high_nibbles(raw) : low_nibbles(raw), top), _mm256_set1_epi8(32)),
          s.lo, s.hi);
    const float d = hd.d;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    s.s_lo = d * static_cast<float>(sc[2 * j]), s.s_hi = d * static_cast<float>(sc[2 * j + 1]), s.off = 0.0f;
    return s;
  }
};

inline __m128i iq4_table() { return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113); }

struct IQ4_XS {
  static constexpr int kValues = 256, kBytes = 136;
  static constexpr bool kSplit = false, kOffset = false;
  using Head = Scales;
  static Head open(const uint8_t* p) {  // d * (ls - 32), ls six bits: 4 in scales_l, 2 in scales_h
    Scales h;
    const float d = half(p);
    const int high = p[2] | (p[3] << 8);
    for (int j = 0; j < 8; ++j) {
      const int ls = (((p[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4)) - 32;
      h.s[j] = d * static_cast<float>(ls), h.off[j] = 0.0f;
    }
    return h;
  }
  static Sub sub(const uint8_t* p, const Head& h, int j) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 + 16 * j)), table = iq4_table();
    Sub s;
    s.lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, low_nibbles(raw)));
    s.hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, high_nibbles(raw)));
    s.s_lo = s.s_hi = h.s[j], s.off = 0.0f;
    return s;
  }
};

struct MXFP4 {
  static constexpr int kValues = 32, kBytes = 17;
  static constexpr bool kSplit = false, kOffset = false;
  using Head = Scale;
  static Head open(const uint8_t* p) {  // 2^(e - 128) from its bits, as ggml_e8m0_to_fp32_half (subnormal below 2)
    const uint32_t e = p[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    Scale h;
    std::memcpy(&h.d, &bits, sizeof bits);
    return h;
  }
  static Sub sub(const uint8_t* p, const Head& h, int) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 1));
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);  // e2m1 doubled
    Sub s;
    s.lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, low_nibbles(raw)));
    s.hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, high_nibbles(raw)));
    s.s_lo = s.s_hi = h.d, s.off = 0.0f;
    return s;
  }
};

}  // namespace offload_native::gguf
