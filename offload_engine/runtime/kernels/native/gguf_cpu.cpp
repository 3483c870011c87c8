// GGUF weights multiplied in place, their blocks as the file holds them (no repack, no dequantized copy): the kernel
// forms of int_cpu.cpp's int_linears / experts_int take a GGUF form too ([blocks uint8 [N, row bytes], meta int64
// (ggml type, K, heads)]: runtime/kernels/select.py makes it, a view of the unit's stored bytes), so dense
// projections, routed experts, the output head and the decode plan reach these kernels through the same calls.
//
// The input is int_cpu.cpp's: quantized once per call, per block of 32, to two digits (x^ = (16 q + r) * scale,
// int_input.h), not llama.cpp's one (Q8_0): the two digits' error is under a bf16 rounding for values above amax / 8
// (tests/test_gguf_native.py measures both against the float input). Per 32 weights the block's integers
// (gguf_blocks.h) times x's joined digits are summed exactly in int32 (VPMADDWD), then scaled in fp32 by the
// block's scale times x's; a K-quant's offset term (-dmin m) times the block's sum of x^. Each output is rounded
// once to bf16.
//
// Determinism: every output element is one thread's sum in a fixed order (blocks in ascending k, then the 8 lanes),
// whatever the thread count or the rows of x beside it.
//
// Instruction sets: AVX2 + F16C (gguf_blocks.h); the AVX-512 build (int_avx512.h's input: the digits q and r, no
// joined x16) joins them per task and sums with VPDPWSSD (AVX512-VNNI on 256-bit vectors), but for Q4_0 and Q8_0,
// whose bytes meet the two digits directly in 512-bit VPDPBUSD (gguf_avx512.h: the same sums in another order),
// and Q4_K likewise (gguf_k_avx512.h).
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16_util.h"
#include "gguf_blocks.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include "gguf_avx512.h"
#include "gguf_k_avx512.h"
#endif
#include "int_input.h"
#include "ops.h"

namespace {

using offload_native::Act;
using offload_native::bf16;
using offload_native::Form;
using offload_native::kBlock;
using offload_native::gguf::stored_row;
namespace gg = offload_native::gguf;

// a tile's NB rows are NB short streams (a row: ~1 KB at K = 2048) that the hardware prefetcher does not ramp up on
// (as int_avx2.h's int8 tiles): the rows kPrefetchTiles tiles ahead are prefetched into L2 at the rate these are
// read (gguf_avx512.h's kAheadTiles says why L2)
constexpr int64_t kPrefetchTiles = 8;

inline float sum8(__m256 v) {  // the 8 lanes in a fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i block_dot(const gg::Sub& s, __m256i xl, __m256i xh) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(s.lo, xl), s.hi, xh);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(s.lo, xl), _mm256_madd_epi16(s.hi, xh));
#endif
}

// NB output rows [n, n + NB) for MB rows of x (x16[m]: row m0 + m's joined digits)
template <class T, int NB, int MB>
void tile(const Form& f, const Act& a, const int16_t* const* x16, int64_t m0, int64_t n, bf16* out, int64_t ldo) {
  constexpr int kSubs = T::kValues / kBlock;
  __m256 acc[NB][MB];
  float off[NB][MB];
  const uint8_t* w[NB];
  for (int r = 0; r < NB; ++r) {
    w[r] = f.blocks + stored_row(f, n + r) * f.row_bytes;
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps(), off[r][m] = 0.0f;
  }
  const int64_t blocks = f.K / T::kValues;
  const char* ahead = reinterpret_cast<const char*>(w[0] + kPrefetchTiles * NB * f.row_bytes);  // (hints never fault)
  for (int64_t u = 0; u < blocks; ++u) {
    for (int64_t at = u * NB * T::kBytes; at < (u + 1) * NB * T::kBytes; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
    typename T::Head head[NB];  // each row's block scales, decoded once
    for (int r = 0; r < NB; ++r) head[r] = T::open(w[r] + u * T::kBytes);
    for (int j = 0; j < kSubs; ++j) {
      const int64_t b = u * kSubs + j;  // the block of 32 along K
      __m256i xl[MB], xh[MB];
      float sx[MB];
      for (int m = 0; m < MB; ++m) {
        xl[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16[m] + b * kBlock));
        xh[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16[m] + b * kBlock + 16));
        sx[m] = a.block_scale(m0 + m, b);
      }
      for (int r = 0; r < NB; ++r) {
        const gg::Sub s = T::sub(w[r] + u * T::kBytes, head[r], j);
        for (int m = 0; m < MB; ++m) {
          if constexpr (T::kSplit) {  // a scale per 16 (exact: each half's sum is below 2^24)
            const __m256i dl = _mm256_madd_epi16(s.lo, xl[m]), dh = _mm256_madd_epi16(s.hi, xh[m]);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), _mm256_set1_ps(s.s_lo * sx[m]), acc[r][m]);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_set1_ps(s.s_hi * sx[m]), acc[r][m]);
          } else {  // |sum| <= 32 * 127 * 2040 < 2^24: exact in float
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(s, xl[m], xh[m])),
                                        _mm256_set1_ps(s.s_lo * sx[m]), acc[r][m]);
          }
          if constexpr (T::kOffset) off[r][m] += s.off * a.sums[(m0 + m) * a.G + b];
        }
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[(m0 + m) * ldo + n + r] = offload_native::to_bf16(sum8(acc[r][m]) + off[r][m]);
}

template <class T, int MB>
void span(const Form& f, const Act& a, const int16_t* const* x16, int64_t m0, int64_t n0, int64_t n1, bf16* out,
          int64_t ldo) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile<T, 4, MB>(f, a, x16, m0, n, out, ldo);
  for (; n < n1; ++n) tile<T, 1, MB>(f, a, x16, m0, n, out, ldo);
}

template <class T>
void rows_of(const Form& f, const Act& a, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  std::vector<const int16_t*> x16(a.M);
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<T, gg::Q4_0> || std::is_same_v<T, gg::Q8_0>) {  // bytes against digits (gguf_avx512.h)
    return gg::fast_rows<std::is_same_v<T, gg::Q8_0>>(f, a, n0, n1, out, ldo);
  }
  if constexpr (std::is_same_v<T, gg::Q4_K>) return gg::q4k_rows(f, a, n0, n1, out, ldo);  // gguf_k_avx512.h
  thread_local std::vector<int16_t> joined;  // int_avx512.h's input keeps the digits apart: joined here, per task
  joined.resize(a.M * a.Kp);
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t k = 0; k < a.Kp; k += 16) {  // 16 q + r, 16 at a time (|.| <= 2040)
      const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.row(m) + k)));
      const __m256i r = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.rest(m) + k)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(joined.data() + m * a.Kp + k),
                          _mm256_add_epi16(_mm256_slli_epi16(q, 4), r));
    }
    x16[m] = joined.data() + m * a.Kp;
  }
#else
  for (int64_t m = 0; m < a.M; ++m) x16[m] = a.joined(m);
#endif
  for (int64_t m0 = 0; m0 < a.M; m0 += 2) {
    if (a.M - m0 >= 2) span<T, 2>(f, a, x16.data() + m0, m0, n0, n1, out, ldo);
    else span<T, 1>(f, a, x16.data() + m0, m0, n0, n1, out, ldo);
  }
}

struct TypeInfo {
  int values, bytes;
  bool offset;
};

TypeInfo info(int type) {
  switch (type) {
    case gg::kQ8_0: return {gg::Q8_0::kValues, gg::Q8_0::kBytes, gg::Q8_0::kOffset};
    case gg::kQ4_0: return {gg::Q4_0::kValues, gg::Q4_0::kBytes, gg::Q4_0::kOffset};
    case gg::kQ4_K: return {gg::Q4_K::kValues, gg::Q4_K::kBytes, gg::Q4_K::kOffset};
    case gg::kQ5_K: return {gg::Q5_K::kValues, gg::Q5_K::kBytes, gg::Q5_K::kOffset};
    case gg::kQ6_K: return {gg::Q6_K::kValues, gg::Q6_K::kBytes, gg::Q6_K::kOffset};
    case gg::kIQ4_XS: return {gg::IQ4_XS::kValues, gg::IQ4_XS::kBytes, gg::IQ4_XS::kOffset};
    case gg::kMXFP4: return {gg::MXFP4::kValues, gg::MXFP4::kBytes, gg::MXFP4::kOffset};
    default: return {0, 0, false};
  }
}

}  // namespace

// [blocks uint8 [N, row bytes], meta int64 [3]: ggml type, K, heads (0: rows in order)] -> the form
Form gguf_form(const torch::Tensor& blocks, const torch::Tensor& meta, const char* what, int64_t e) {
  TORCH_CHECK(meta.device().is_cpu() && meta.scalar_type() == torch::kLong && meta.numel() == 3 && meta.is_contiguous(),
              what, " of expert ", e, ": a GGUF form's meta is int64 [type, K, heads]");
  const int64_t* m = meta.data_ptr<int64_t>();
  const TypeInfo t = info(static_cast<int>(m[0]));
  TORCH_CHECK(t.values > 0, what, " of expert ", e, ": GGUF type id ", m[0], " has no native kernel");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), what, " of expert ", e, ": GGUF blocks must be contiguous uint8 [N, bytes]");
  Form f;
  f.gguf = static_cast<int>(m[0]);
  f.K = m[1], f.heads = m[2];
  f.N = blocks.size(0), f.row_bytes = blocks.size(1);
  TORCH_CHECK(f.K > 0 && f.K % t.values == 0 && f.row_bytes == f.K / t.values * t.bytes, what, " of expert ", e,
              ": ", f.row_bytes, " bytes a row do not hold ", f.K, " values of GGUF type ", m[0]);
  TORCH_CHECK(f.heads == 0 || (f.N % f.heads == 0 && (f.N / f.heads) % 2 == 0), what, " of expert ", e, ": ", f.N,
              " rows are not ", f.heads, " heads of rope pairs");
  f.blocks = blocks.data_ptr<uint8_t>();
  f.G = t.offset ? f.K / kBlock : 1;  // a K-quant's offset term takes each block's sum of x^
  return f;
}

// rows [n0, n1) of a GGUF form for every row of x
void gguf_rows(const Form& f, const Act& a, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  switch (f.gguf) {
    case gg::kQ8_0: return rows_of<gg::Q8_0>(f, a, n0, n1, out, ldo);
    case gg::kQ4_0: return rows_of<gg::Q4_0>(f, a, n0, n1, out, ldo);
    case gg::kQ4_K: return rows_of<gg::Q4_K>(f, a, n0, n1, out, ldo);
    case gg::kQ5_K: return rows_of<gg::Q5_K>(f, a, n0, n1, out, ldo);
    case gg::kQ6_K: return rows_of<gg::Q6_K>(f, a, n0, n1, out, ldo);
    case gg::kIQ4_XS: return rows_of<gg::IQ4_XS>(f, a, n0, n1, out, ldo);
    case gg::kMXFP4: return rows_of<gg::MXFP4>(f, a, n0, n1, out, ldo);
    default: TORCH_CHECK(false, "GGUF type id ", f.gguf, " has no native kernel");
  }
}

// the ggml type ids these kernels read (runtime/gguf_dequant.NATIVE_TYPES names them)
std::vector<int64_t> gguf_types() {
  return {gg::kQ4_0, gg::kQ8_0, gg::kQ4_K, gg::kQ5_K, gg::kQ6_K, gg::kIQ4_XS, gg::kMXFP4};
}
