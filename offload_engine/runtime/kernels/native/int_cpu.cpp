// Weight-only int8 / int4 matrix-vector kernels for x86 CPUs (built with bf16_cpu.cpp: native_build.py); the inner
// loops: int_avx512.h with AVX512-VNNI and VBMI, int_avx2.h with AVX2 (which says how it differs from the below).
//
// The weights are read in the kernel forms runtime/kernels/cpu_int.py makes for torch's CPU kernels (a unit's slot
// holds one form, whichever kernel multiplies it):
//   int8  q int8 [N, K], s [N], optional zero term t [N]:      W[n, k] = q[n, k] * s[n] - t[n]
//   int4  torch's CPU int4 pack uint8 [N, K/2], sz [K/g, N, 2]: W[n, k] = (q[n, k] - 8) * s + z in group k / g
//         (rows in blocks of kInt4BlockRows: 64 where torch's kernel runs AVX-512, 32 with AVX2)
//
// The input is quantized once per call, per block of 32 values, to two int8 digits (llama.cpp quantizes its
// activations to one, Q8_0): q = round(x * 127 / amax), then the rest x - q * amax / 127 to r in -8..8 sixteenths
// of that step, so x^ = (16 q + r) * amax / 2032: 12 bits of the block's range, an error under a bf16 rounding for
// every value above amax / 8 (one digit alone gave ~1% of a projection's output on the tests' models, several times
// torch's bf16 path). The kernel computes x^ @ W.T exactly in integers within a block (VPDPBUSD: 64 byte products
// summed into 16 int32 lanes, twice: 16 dot(w, q) + dot(w, r)), in fp32 across blocks, and rounds each output once
// to bf16. Widening each weight to fp32 instead (the previous kernel) cost ~12 vector ops per 64 weights and ran at
// 12-13 GB/s, compute-bound, where the memory gives ~35. Tests compare against dequantize-then-matmul on x^.
//   int8  VPDPBUSD multiplies unsigned by signed bytes: the weight is flipped to q + 128 (one XOR) and the
//         128 * sum(x^) it adds is taken off once per row: y = s * (sum_blocks dot(q + 128, x^) - 128 S) - S t
//   int4  the nibbles are unsigned already (0..15, and 16 q still fits a byte): per group
//         s * sum_blocks dot(q, x^) + (z - 8 s) * S_g; the pack's bytes hold rows i (low nibble) and i + 32 (high)
//         of a 64-row block at each k (AVX-512's layout), so four k's bytes are regrouped (VPERMT2B) into one
//         32-bit lane per row.
//   S, S_g: the sums of x^ over the row / over group g.
//
// Determinism: every output element is one thread's sum in a fixed order (integers within a block, then blocks in
// ascending k in fp32, then the 16 lanes' reduction), whatever the thread count, the split of the rows or the other
// experts of the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16_util.h"
#include "int_input.h"
#include "ops.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include "int_avx512.h"
#else
#include "int_avx2.h"
#endif

namespace {

using offload_native::bf16;
using offload_native::to_bf16;
using offload_native::to_float;
using offload_native::Act;
using offload_native::kBlock;
using offload_native::kChunk;
using offload_native::Form;
using offload_native::int4_block;
using offload_native::int8_rows;
using offload_native::prepare;
struct Proj {
  Form f;
  const Act* a;
  bf16* out;  // [M, ldo], this projection's columns starting at out
  int64_t ldo;
  const bf16* weight = nullptr;  // an expert's down projection: its M routing weights (weight_step apart), applied
  int64_t weight_step = 0;       //   to each output once rounded, as torch's bf16 multiply rounds it
};

template <typename T>
const T* data(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

constexpr int64_t kB = offload_native::kInt4BlockRows, kHalf = kB / 2;  // the int4 pack's rows per block

// The pack's last N % kB rows (byte (k, j) = rows 2j | 2j + 1 << 4) laid out as a block, rows past them zero
const uint8_t* rest_as_block(const Form& f, int64_t full, std::vector<uint8_t>& buf) {
  const int64_t R = f.N - full, ld = R / 2, K = f.K;
  const uint8_t* rest = f.q4 + full * K / 2;
  auto nib = [&](int64_t k, int64_t r) -> uint8_t {
    return r < R ? (rest[k * ld + r / 2] >> (4 * (r % 2))) & 15 : 0;
  };
  buf.resize(K * kHalf);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t i = 0; i < kHalf; ++i) buf[k * kHalf + i] = nib(k, i) | nib(k, kHalf + i) << 4;
  return buf.data();
}

template <int MB>
void int8_span(const Form& f, const Act& a, int64_t m0, int64_t n0, int64_t n1, bf16* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) int8_rows<4, MB>(f, a, m0, n, out, ldo);
  for (; n < n1; ++n) int8_rows<1, MB>(f, a, m0, n, out, ldo);
}

// a block of the pack (or the rows after the last one) for every row of x
void int4_rows(const Form& f, const Act& a, int64_t r0, bf16* out, int64_t ldo) {
  const int64_t full = f.N / kB * kB;
  thread_local std::vector<uint8_t> buf;
  const uint8_t* base = r0 < full ? f.q4 + r0 * f.K / 2 : rest_as_block(f, full, buf);
  const int rows = static_cast<int>(std::min<int64_t>(kB, f.N - r0));
  for (int64_t m = 0; m < a.M; ++m) int4_block(f, a, m, base, r0, rows, out, ldo);
}

// rows [n0, n1) of a projection for every row of x (int4: n0 and n1 on the pack's blocks, or N)
void run_rows(const Proj& p, int64_t n0, int64_t n1) {
  const Act& a = *p.a;
  if (p.f.gguf != 0) {  // a GGUF form: its blocks in place (gguf_cpu.cpp)
    gguf_rows(p.f, a, n0, n1, p.out, p.ldo);
    return;
  }
  if (p.f.int4) {
    for (int64_t r = n0; r < n1; r += kB) int4_rows(p.f, a, r, p.out, p.ldo);
    return;
  }
  for (int64_t m0 = 0; m0 < a.M;) {
    const int64_t mb = std::min<int64_t>(4, a.M - m0);
    if (mb == 4) int8_span<4>(p.f, a, m0, n0, n1, p.out, p.ldo);
    else if (mb == 3) int8_span<3>(p.f, a, m0, n0, n1, p.out, p.ldo);
    else if (mb == 2) int8_span<2>(p.f, a, m0, n0, n1, p.out, p.ldo);
    else int8_span<1>(p.f, a, m0, n0, n1, p.out, p.ldo);
    m0 += mb;
  }
}

struct Task {
  int64_t proj, n0, n1;
};

// every projection's rows cut into tasks (int8: 16 rows; int4: a block of the pack, or the rows after the last one),
// run in one parallel region
void run_all(const std::vector<Proj>& projs) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < static_cast<int64_t>(projs.size()); ++i) {
    const Form& f = projs[i].f;
    const int64_t step = f.int4 ? kB : 16;
    for (int64_t n = 0; n < f.N; n += step) tasks.push_back({i, n, std::min(f.N, n + step)});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Proj& p = projs[tasks[t].proj];
      run_rows(p, tasks[t].n0, tasks[t].n1);
      if (p.weight != nullptr)
        offload_native::weigh_rows(p.out, p.ldo, p.a->M, p.weight, p.weight_step, tasks[t].n0, tasks[t].n1);
    }
  });
}

void check_x(const torch::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              what, ": expected a 2-D CPU bfloat16 tensor with contiguous rows");
  TORCH_CHECK(x.size(1) == K, what, " has ", x.size(1), " columns, the weight ", K);
}

}  // namespace

Form int_form(const std::vector<torch::Tensor>& parts, const char* what, int64_t e) {
  if (parts.size() == 2 && parts[1].scalar_type() == torch::kLong) return gguf_form(parts[0], parts[1], what, e);
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
    TORCH_CHECK(f.G > 0 && f.K % f.G == 0 && (f.K / f.G) % kBlock == 0, what, " of expert ", e, ": ", f.G,
                " groups of a multiple of 32 inputs do not divide ", f.K);
  }
  f.s = data<bf16>(s);
  return f;
}

// x [M, K] @ W_i.T for several int8 / int4 kernel forms of one input (an attention's q, k and v): x quantized once
// per group size, one parallel region; each output the same bits as alone
std::vector<torch::Tensor> int_linears(const torch::Tensor& x, const std::vector<std::vector<torch::Tensor>>& forms) {
  const int64_t P = static_cast<int64_t>(forms.size());
  std::vector<Act> acts(P);
  std::vector<torch::Tensor> out(P);
  std::vector<Proj> projs;
  for (int64_t i = 0; i < P; ++i) {
    const Form f = int_form(forms[i], "weight", i);
    check_x(x, f.K, "x");
    const Act* a = nullptr;
    for (int64_t j = 0; j < i && a == nullptr; ++j)
      if (acts[j].G == f.G && acts[j].K == f.K) a = &acts[j];
    if (a == nullptr) {
      prepare(acts[i], data<bf16>(x), x.stride(0), x.size(0), f.K, f.G);
      a = &acts[i];
    }
    out[i] = torch::empty({x.size(0), f.N}, x.options());
    projs.push_back({f, a, reinterpret_cast<bf16*>(out[i].data_ptr()), f.N});
  }
  run_all(projs);
  return out;
}

// the rows per block of the int4 pack these kernels read (the runtime takes them only where torch packs alike)
int64_t int4_block_rows() { return kB; }

// x [M, K] @ W.T for an int8 or int4 kernel form (parts: [weight, scale] or [weight, scale, zero term]) -> bf16
torch::Tensor int_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts) {
  return int_linears(x, {parts})[0];
}

// Routed experts with a gated SiLU MLP whose projections are int8 / int4 kernel forms, rounded as
// runtime/arch/base.expert_forward rounds them in bf16 (each product, silu(g), g * u, the routing weight):
// part_e = w_e * down_e(silu(gate_e x_e) * (up_e x_e)), into rows[e].out. Three parallel regions: every gate and up
// projection; silu(g) * u and the down projections' inputs, experts split over the threads; every down projection
// and its routing weight. The scratch is the calling thread's, kept between calls of up to kKeptRows rows.
void run_experts_int(const std::vector<const ExpertForms*>& forms, const std::vector<ExpertRows>& rows) {
  const int64_t E = static_cast<int64_t>(forms.size());
  thread_local std::vector<Act> xin_tl, hin_tl;  // x for each expert's gate and up forms (their groups may differ)
  thread_local std::vector<bf16> gu_tl;
  std::vector<Act>&xin = xin_tl, &hin = hin_tl;  // the caller's, also inside the regions (not the workers')
  std::vector<bf16>& gu = gu_tl;
  xin.resize(2 * E);
  hin.resize(E);
  for (auto& a : xin) a.source = nullptr;  // a previous call's inputs match nothing
  std::vector<int64_t> at(E + 1, 0);  // expert e's [M, 2I] gate | up outputs at gu[at[e]]
  for (int64_t e = 0; e < E; ++e) at[e + 1] = at[e] + rows[e].M * 2 * forms[e]->inter;
  if (static_cast<int64_t>(gu.size()) < at[E]) gu.resize(at[E]);
  // the same x (decode: every expert's) converted once per group size: the values are the same either way
  auto input = [&](int64_t slot, const ExpertRows& r, int64_t K, int64_t G) -> const Act* {
    for (int64_t i = 0; i < slot; ++i)
      if (xin[i].source == r.x && xin[i].ldx == r.ldx && xin[i].M == r.M && xin[i].K == K && xin[i].G == G)
        return &xin[i];
    prepare(xin[slot], r.x, r.ldx, r.M, K, G);
    return &xin[slot];
  };
  std::vector<Proj> projs;
  for (int64_t e = 0; e < E; ++e) {
    const ExpertForms& f = *forms[e];
    const int64_t I = f.inter;
    bf16* o = gu.data() + at[e];
    projs.push_back({f.qgate, input(2 * e, rows[e], f.qgate.K, f.qgate.G), o, 2 * I});
    if (f.qup.N > 0) projs.push_back({f.qup, input(2 * e + 1, rows[e], f.qup.K, f.qup.G), o + I, 2 * I});
  }
  run_all(projs);
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {  // h = bf16(bf16(silu(g)) * u), quantized for down
    thread_local std::vector<bf16> h;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t M = rows[e].M, I = forms[e]->inter;
      const bf16* p = gu.data() + at[e];
      h.resize(M * I);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < I; ++i)
          h[m * I + i] = offload_native::silu_times(p[m * 2 * I + i], p[m * 2 * I + I + i]);
      prepare(hin[e], h.data(), I, M, I, forms[e]->qdown.G);
    }
  });
  projs.clear();
  for (int64_t e = 0; e < E; ++e)
    projs.push_back({forms[e]->qdown, &hin[e], rows[e].out, rows[e].ldo, rows[e].weight, rows[e].weight_step});
  run_all(projs);
  if (!keeps_scratch(rows)) {
    std::vector<Act>().swap(xin), std::vector<Act>().swap(hin), std::vector<bf16>().swap(gu);
  }
}

// run_experts_int over tensors (experts_on): xs[e] [M_e, K] bf16 rows; gates[e] / ups[e] / downs[e]: the forms'
// tensors (an empty ups[e]: gates[e] is the fused gate_up form); weights[e]: M_e bf16 routing weights -> each
// expert's part
std::vector<torch::Tensor> experts_int(const std::vector<torch::Tensor>& xs,
                                       const std::vector<std::vector<torch::Tensor>>& gates,
                                       const std::vector<std::vector<torch::Tensor>>& ups,
                                       const std::vector<std::vector<torch::Tensor>>& downs,
                                       const std::vector<torch::Tensor>& weights) {
  TORCH_CHECK(gates.size() == xs.size() && ups.size() == xs.size() && downs.size() == xs.size(),
              "one x, gate, up, down and weight per expert");
  std::vector<ExpertForms> forms;
  for (size_t e = 0; e < xs.size(); ++e) {
    TORCH_CHECK(gates[e].size() > 1, "expert ", e, ": expected int8 / int4 kernel forms, got a plain weight");
    forms.push_back(expert_forms(gates[e], ups[e], downs[e], static_cast<int64_t>(e)));
  }
  return experts_on(xs, forms, weights);
}
