// Weight-only int8 / int4 matrix-vector kernels for x86 CPUs with AVX512 (built with bf16_cpu.cpp: native_build.py).
//
// The weights are read in the kernel forms runtime/kernels/cpu_int.py makes for torch's CPU kernels (a unit's slot
// holds one form, whichever kernel multiplies it):
//   int8  q int8 [N, K], s [N], optional zero term t [N]:      y[n] = s[n] * (x . q[n]) - sum(x) * t[n]
//   int4  torch's CPU int4 pack uint8 [N, K/2], sz [K/g, N, 2]: W[n, k] = (q[n, k] - 8) * s + z in group k / g
// Activations and scales are bf16, converted to fp32; a weight is converted in registers (int8 -> fp32 exactly; a
// nibble -> q - 8 in fp32 by a 16-entry table lookup, VPERMPS); products and sums in fp32, one bf16 rounding per
// output, as torch's kernels round. int4: per group sum_k x_k (q_nk - 8), then * s + z * sum_k x_k (exact algebra
// on the format's definition), so the scale costs one FMA per group, not per weight.
//
// Why: torch's weight-only kernels cost ~12 small ops per routed expert from Python and reach a fraction of the
// memory bandwidth at decode's one row; here one call computes all of a layer's resident routed experts.
//
// Determinism: as in bf16_cpu.cpp every output element is one thread's sum in a fixed order (int8: ascending k in
// 16 lanes, then the lanes' reduction; int4: each group over ascending k, groups ascending), whatever the thread
// count, the split of the rows or the other experts of the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_util.h"

namespace {

using offload_native::bf16;
using offload_native::to_bf16;
using offload_native::to_float;

struct Form {  // one projection's weight in its kernel form
  bool int4 = false;
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const bf16* s = nullptr;  // int8: [N]; int4: [G, N, 2] (scale, zero) pairs
  const bf16* t = nullptr;  // int8: zero term [N] or null
  int64_t N = 0, K = 0, G = 1;  // G: groups of K (int4), 1 (int8)
};

struct Act {  // a projection's input: x in fp32 [M, K] and its sums per group [M, G]
  std::vector<float> x, sums;
  int64_t M = 0, K = 0, G = 1;
  const void* source = nullptr;  // the bf16 rows it was made from (experts routed the same x share it)
  int64_t ldx = 0;
};

struct Proj {
  Form f;
  const Act* a;
  bf16* out;  // [M, ldo], this projection's columns starting at out
  int64_t ldo;
};

template <typename T>
const T* data(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

Form form_of(const std::vector<torch::Tensor>& parts, const char* what, int64_t e) {
  TORCH_CHECK(parts.size() == 2 || parts.size() == 3, what, " of expert ", e,
              ": expected [weight, scale] or [weight, scale, zero term]");
  const auto &w = parts[0], &s = parts[1];
  for (const auto& p : parts)
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), what, " of expert ", e, ": expected contiguous CPU tensors");
  TORCH_CHECK(s.scalar_type() == torch::kBFloat16, what, " of expert ", e, ": scales must be bfloat16");
  Form f;
  if (w.scalar_type() == torch::kChar) {
    TORCH_CHECK(w.dim() == 2 && s.numel() == w.size(0), what, " of expert ", e, ": int8 [N, K] with [N] scales");
    f.q8 = data<int8_t>(w);
    f.N = w.size(0);
    f.K = w.size(1);
    if (parts.size() == 3) {
      TORCH_CHECK(parts[2].scalar_type() == torch::kBFloat16 && parts[2].numel() == f.N, what, " of expert ", e,
                  ": the zero term must be bfloat16 [N]");
      f.t = data<bf16>(parts[2]);
    }
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kByte && s.dim() == 3 && s.size(2) == 2 && parts.size() == 2, what,
                " of expert ", e, ": int4 pack uint8 with [K/g, N, 2] scales and zeros");
    f.int4 = true;
    f.q4 = data<uint8_t>(w);
    f.N = s.size(1);
    f.G = s.size(0);
    TORCH_CHECK(f.N % 2 == 0 && (w.numel() * 2) % f.N == 0, what, " of expert ", e, ": ", w.numel(),
                " packed bytes for ", f.N, " rows");
    f.K = w.numel() * 2 / f.N;
    TORCH_CHECK(f.G > 0 && f.K % f.G == 0, what, " of expert ", e, ": ", f.G, " groups do not divide ", f.K);
  }
  f.s = data<bf16>(s);
  return f;
}

// x (bf16 rows, ldx apart) in fp32, and its sums over each of G equal groups of k (ascending k)
void prepare(Act& a, const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t G) {
  a.M = M, a.K = K, a.G = G, a.source = x, a.ldx = ldx;
  a.x.resize(M * K);
  a.sums.assign(M * G, 0.0f);
  const int64_t g = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t group = 0; group < G; ++group) {
      float sum = 0.0f;
      for (int64_t k = group * g; k < (group + 1) * g; ++k) {
        float v = to_float(x[m * ldx + k]);
        a.x[m * K + k] = v;
        sum += v;
      }
      a.sums[m * G + group] = sum;
    }
}

// ---- int8: NB weight rows at a time (independent FMA chains), MB rows of x per pass ---------------------------
template <int NB, int MB>
void int8_rows(const Form& f, const Act& a, int64_t m0, int64_t n, bf16* out, int64_t ldo) {
  __m512 acc[NB][MB];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t K = f.K;
  const float* x = a.x.data() + m0 * K;
  const int8_t* w = f.q8 + n * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < NB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + 256), _MM_HINT_T0);
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(w + r * K + k))));
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  if (k < K) {  // the same lanes, masked
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int r = 0; r < NB; ++r) {
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * K + k)));
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < NB; ++r) {
    const float s = to_float(f.s[n + r]);
    for (int m = 0; m < MB; ++m) {
      float y = s * _mm512_reduce_add_ps(acc[r][m]);
      if (f.t != nullptr) y -= a.sums[(m0 + m) * a.G] * to_float(f.t[n + r]);
      out[(m0 + m) * ldo + n + r] = to_bf16(y);
    }
  }
}

template <int MB>
void int8_span(const Form& f, const Act& a, int64_t m0, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) int8_rows<4, MB>(f, a, m0, n, out, ldo);
  for (; n < n1; ++n) int8_rows<1, MB>(f, a, m0, n, out, ldo);
}

// ---- int4: a tile of up to 32 bytes per k (H halves of 16), each byte two rows (low and high nibble) -----------
struct Tile {
  const uint8_t* base;  // byte (k, j) at base[k * ld + j]
  int64_t ld;
  int nbytes;  // <= 16 * H
  int32_t lo[32], hi[32];  // the rows of byte j's low and high nibble
  bool contiguous;  // lo[16h + j] = lo[16h] + j (and hi alike): scales loaded, not gathered
};

inline void scale_zero(const Form& f, int64_t group, const int32_t* rows, bool contiguous, __mmask16 mask,
                       __m512& s, __m512& z) {
  const int* pairs = reinterpret_cast<const int*>(f.s + group * f.N * 2);  // one (scale, zero) pair per row
  __m512i v = contiguous ? _mm512_maskz_loadu_epi32(mask, pairs + rows[0])
                         : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask,
                                                       _mm512_maskz_loadu_epi32(mask, rows), pairs, 4);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int H, int MB>
void int4_tile(const Form& f, const Act& a, int64_t m0, const Tile& t, bf16* out, int64_t ldo) {
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __mmask16 mask[H];
  for (int h = 0; h < H; ++h) {
    int n = std::max(0, std::min(16, t.nbytes - 16 * h));
    mask[h] = static_cast<__mmask16>((1u << n) - 1);
  }
  __m512 tot_lo[H][MB], tot_hi[H][MB];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MB; ++m) tot_lo[h][m] = tot_hi[h][m] = _mm512_setzero_ps();
  const int64_t K = f.K, g = K / f.G;
  const float* x = a.x.data() + m0 * K;
  for (int64_t group = 0; group < f.G; ++group) {
    __m512 lo_acc[H][MB], hi_acc[H][MB];
    for (int h = 0; h < H; ++h)
      for (int m = 0; m < MB; ++m) lo_acc[h][m] = hi_acc[h][m] = _mm512_setzero_ps();
    for (int64_t k = group * g; k < (group + 1) * g; ++k) {
      // 2 KB ahead of a block (hints do not fault past the end)
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(t.base + (k + 64) * t.ld), _MM_HINT_T0);
      __m512 xb[MB];
      for (int m = 0; m < MB; ++m) xb[m] = _mm512_set1_ps(x[m * K + k]);
      for (int h = 0; h < H; ++h) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask[h], t.base + k * t.ld + 16 * h));
        __m512 lo = _mm512_permutexvar_ps(b, table);  // the low 4 bits of each lane index the table
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
        for (int m = 0; m < MB; ++m) {
          lo_acc[h][m] = _mm512_fmadd_ps(lo, xb[m], lo_acc[h][m]);
          hi_acc[h][m] = _mm512_fmadd_ps(hi, xb[m], hi_acc[h][m]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      __m512 s_lo, z_lo, s_hi, z_hi;
      scale_zero(f, group, t.lo + 16 * h, t.contiguous, mask[h], s_lo, z_lo);
      scale_zero(f, group, t.hi + 16 * h, t.contiguous, mask[h], s_hi, z_hi);
      for (int m = 0; m < MB; ++m) {
        const __m512 sum = _mm512_set1_ps(a.sums[(m0 + m) * a.G + group]);
        tot_lo[h][m] = _mm512_fmadd_ps(z_lo, sum, _mm512_fmadd_ps(lo_acc[h][m], s_lo, tot_lo[h][m]));
        tot_hi[h][m] = _mm512_fmadd_ps(z_hi, sum, _mm512_fmadd_ps(hi_acc[h][m], s_hi, tot_hi[h][m]));
      }
    }
  }
  alignas(64) float lo[16], hi[16];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MB; ++m) {
      _mm512_store_ps(lo, tot_lo[h][m]);
      _mm512_store_ps(hi, tot_hi[h][m]);
      bf16* row = out + (m0 + m) * ldo;
      for (int j = 0; j < 16 && 16 * h + j < t.nbytes; ++j) {
        row[t.lo[16 * h + j]] = to_bf16(lo[j]);
        row[t.hi[16 * h + j]] = to_bf16(hi[j]);
      }
    }
}

// The tile of rows [r0, r0 + 64) (a full block of the pack) or of the last N % 64 rows (r0 = N / 64 * 64)
Tile tile_at(const Form& f, int64_t r0) {
  Tile t;
  const int64_t full = f.N / 64 * 64;
  if (r0 < full) {  // block: byte (k, j) holds rows r0 + j (low) and r0 + 32 + j (high), 32 bytes a k
    t.base = f.q4 + r0 * f.K / 2;
    t.ld = 32;
    t.nbytes = 32;
    t.contiguous = true;
    for (int j = 0; j < 32; ++j) t.lo[j] = r0 + j, t.hi[j] = r0 + 32 + j;
  } else {  // the rest: byte (k, j) holds rows full + 2j (low) and full + 2j + 1 (high)
    t.base = f.q4 + full * f.K / 2;
    t.ld = (f.N - full) / 2;
    t.nbytes = static_cast<int>(t.ld);
    t.contiguous = false;
    for (int j = 0; j < 32; ++j) {
      t.lo[j] = j < t.nbytes ? full + 2 * j : 0;
      t.hi[j] = j < t.nbytes ? full + 2 * j + 1 : 0;
    }
  }
  return t;
}

template <int MB>
void int4_rows(const Form& f, const Act& a, int64_t m0, int64_t r0, bf16* out, int64_t ldo) {
  Tile t = tile_at(f, r0);
  if (t.nbytes > 16) int4_tile<2, MB>(f, a, m0, t, out, ldo);
  else int4_tile<1, MB>(f, a, m0, t, out, ldo);
}

// rows [n0, n1) of a projection for every row of x (int4: n0 and n1 on the pack's 64-row blocks, or N)
void run_rows(const Proj& p, int64_t n0, int64_t n1) {
  const Act& a = *p.a;
  for (int64_t m0 = 0; m0 < a.M;) {
    const int64_t mb = p.f.int4 ? std::min<int64_t>(2, a.M - m0) : std::min<int64_t>(4, a.M - m0);
    if (p.f.int4) {
      for (int64_t r = n0; r < n1; r += 64) {
        if (mb == 2) int4_rows<2>(p.f, a, m0, r, p.out, p.ldo);
        else int4_rows<1>(p.f, a, m0, r, p.out, p.ldo);
      }
    } else if (mb == 4) int8_span<4>(p.f, a, m0, n0, n1, p.out, p.ldo);
    else if (mb == 3) int8_span<3>(p.f, a, m0, n0, n1, p.out, p.ldo);
    else if (mb == 2) int8_span<2>(p.f, a, m0, n0, n1, p.out, p.ldo);
    else int8_span<1>(p.f, a, m0, n0, n1, p.out, p.ldo);
    m0 += mb;
  }
}

struct Task {
  int64_t proj, n0, n1;
};

// every projection's rows cut into tasks (int8: 16 rows; int4: a 64-row block, or the rows after the last one),
// run in one parallel region
void run_all(const std::vector<Proj>& projs) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < static_cast<int64_t>(projs.size()); ++i) {
    const Form& f = projs[i].f;
    const int64_t step = f.int4 ? 64 : 16;
    for (int64_t n = 0; n < f.N; n += step) tasks.push_back({i, n, std::min(f.N, n + step)});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run_rows(projs[tasks[t].proj], tasks[t].n0, tasks[t].n1);
  });
}

void check_x(const torch::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              what, ": expected a 2-D CPU bfloat16 tensor with contiguous rows");
  TORCH_CHECK(x.size(1) == K, what, " has ", x.size(1), " columns, the weight ", K);
}

}  // namespace

// x [M, K] @ W.T for an int8 or int4 kernel form (parts: [weight, scale] or [weight, scale, zero term]) -> bf16
torch::Tensor int_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts) {
  const Form f = form_of(parts, "weight", 0);
  check_x(x, f.K, "x");
  auto out = torch::empty({x.size(0), f.N}, x.options());
  Act a;
  prepare(a, data<bf16>(x), x.stride(0), x.size(0), f.K, f.G);
  run_all({Proj{f, &a, reinterpret_cast<bf16*>(out.data_ptr()), f.N}});
  return out;
}

// Routed experts with a gated SiLU MLP whose projections are int8 / int4 kernel forms, rounded as
// runtime/arch/base.expert_forward rounds them in bf16 (each product, silu(g), g * u, the routing weight):
// parts[e] = w_e * down_e(silu(gate_e x_e) * (up_e x_e)). gates[e] / ups[e] / downs[e]: the forms' tensors; an
// empty ups[e] means gates[e] is the fused gate_up form (2I rows: gate, then up).
std::vector<torch::Tensor> experts_int(const std::vector<torch::Tensor>& xs,
                                       const std::vector<std::vector<torch::Tensor>>& gates,
                                       const std::vector<std::vector<torch::Tensor>>& ups,
                                       const std::vector<std::vector<torch::Tensor>>& downs,
                                       const std::vector<torch::Tensor>& weights) {
  const int64_t E = static_cast<int64_t>(xs.size());
  TORCH_CHECK(gates.size() == xs.size() && ups.size() == xs.size() && downs.size() == xs.size() &&
              weights.size() == xs.size(), "one x, gate, up, down and weight per expert");
  std::vector<Form> down(E);
  std::vector<int64_t> inter(E);
  std::vector<Act> xin(E * 2), hin(E);  // x for each expert's gate and up forms (their groups may differ)
  // the same x (decode: every expert's) converted once per group size: the values are the same either way
  auto input = [&](int64_t slot, const torch::Tensor& x, int64_t K, int64_t G) -> const Act* {
    for (int64_t i = 0; i < slot; ++i)
      if (xin[i].source == x.data_ptr() && xin[i].ldx == x.stride(0) && xin[i].M == x.size(0) && xin[i].K == K &&
          xin[i].G == G)
        return &xin[i];
    prepare(xin[slot], data<bf16>(x), x.stride(0), x.size(0), K, G);
    return &xin[slot];
  };
  std::vector<torch::Tensor> gu(E), out(E);
  std::vector<Proj> projs;
  for (int64_t e = 0; e < E; ++e) {
    const Form g = form_of(gates[e], "gate", e);
    const bool fused = ups[e].empty();
    const Form u = fused ? g : form_of(ups[e], "up", e);
    down[e] = form_of(downs[e], "down", e);
    inter[e] = fused ? g.N / 2 : g.N;
    check_x(xs[e], g.K, "x");
    TORCH_CHECK(u.K == g.K && (fused || u.N == g.N) && down[e].K == inter[e] && g.N % (fused ? 2 : 1) == 0,
                "expert ", e, ": gate/up/down shapes do not chain");
    TORCH_CHECK(weights[e].scalar_type() == torch::kBFloat16 && weights[e].numel() == xs[e].size(0), "expert ", e,
                ": expected one bfloat16 routing weight per token");
    const int64_t M = xs[e].size(0);
    gu[e] = torch::empty({M, 2 * inter[e]}, xs[e].options());
    out[e] = torch::empty({M, down[e].N}, xs[e].options());
    bf16* o = reinterpret_cast<bf16*>(gu[e].data_ptr());
    projs.push_back({g, input(2 * e, xs[e], g.K, g.G), o, 2 * inter[e]});
    if (!fused) {
      projs.push_back({u, input(2 * e + 1, xs[e], u.K, u.G), o + inter[e], 2 * inter[e]});
    }
  }
  run_all(projs);
  projs.clear();
  std::vector<bf16> h;
  for (int64_t e = 0; e < E; ++e) {  // h = bf16(bf16(silu(g)) * u), then the down projection's input
    const int64_t M = gu[e].size(0), I = inter[e];
    const bf16* p = data<bf16>(gu[e]);
    h.resize(M * I);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < I; ++i) h[m * I + i] = offload_native::silu_times(p[m * 2 * I + i], p[m * 2 * I + I + i]);
    prepare(hin[e], h.data(), I, M, I, down[e].G);
    projs.push_back({down[e], &hin[e], reinterpret_cast<bf16*>(out[e].data_ptr()), down[e].N});
  }
  run_all(projs);
  for (int64_t e = 0; e < E; ++e) {  // the routing weight, rounded as torch's bf16 multiply rounds it
    auto wt = weights[e].contiguous();
    const bf16* wp = data<bf16>(wt);
    bf16* op = reinterpret_cast<bf16*>(out[e].data_ptr());
    const int64_t H = out[e].size(1);
    for (int64_t m = 0; m < out[e].size(0); ++m)
      for (int64_t j = 0; j < H; ++j) op[m * H + j] = to_bf16(to_float(op[m * H + j]) * to_float(wp[m]));
  }
  return out;
}
