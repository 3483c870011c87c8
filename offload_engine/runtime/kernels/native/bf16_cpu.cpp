// bfloat16 matrix-vector kernels for x86 CPUs (native_build.py builds and loads this; the inner dot products:
// bf16_dot_avx512.h with AVX512-BF16, bf16_dot_avx2.h with AVX2 and FMA).
//
// Why: for the few rows of a decode step (M <= ~16), torch's bf16 matmul goes through oneDNN's brgemm, which
// reaches 9-19 GB/s on the bench shapes on 2 cores where the memory gives ~27 GB/s (without AVX512-BF16 torch
// converts, slower still); and a routed expert costs a dozen small torch ops. Here a weight row is read once for
// all the rows of x, and one call computes all of a layer's resident routed experts.
//
// Determinism: every output element is one thread's dot product over k in ascending order, so a result does not
// depend on the thread count, on how the rows are split, or on which other experts share the call (an expert's
// output is the same bits computed alone or grouped: the runtime relies on that to stay independent of placement).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "bf16_util.h"
#include "ops.h"
#if defined(__AVX512BF16__)
#include "bf16_dot_avx512.h"
#else
#include "bf16_dot_avx2.h"
#endif

namespace {

using offload_native::bf16;
using offload_native::dot_tile;
using offload_native::kPrefetchTiles;
using offload_native::to_bf16;
using offload_native::to_float;
constexpr int64_t kMaxRows = 16;  // rows of x per weight-row pass (accumulators kept in registers/L1)

template <int R>
inline void dot_rows(const bf16* w, int64_t ldw, const bf16* x, int64_t ldx, int64_t M, int64_t K, float* y,
                     const char* ahead) {
  // y [R][kMaxRows]: x's rows 4 at a time (the R weight rows stay in L1 between passes)
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile<R, 4>(w, ldw, x + m * ldx, ldx, K, y + m, kMaxRows, ahead);
  switch (M - m) {
    case 3: dot_tile<R, 3>(w, ldw, x + m * ldx, ldx, K, y + m, kMaxRows, ahead); break;
    case 2: dot_tile<R, 2>(w, ldw, x + m * ldx, ldx, K, y + m, kMaxRows, ahead); break;
    case 1: dot_tile<R, 1>(w, ldw, x + m * ldx, ldx, K, y + m, kMaxRows, ahead); break;
    default: break;
  }
}

// out[m][n] = bf16(sum_k W[n][k] x[m][k]) for n in [n0, n1): weight rows 4 at a time, each read once for all
// of x's rows (M <= kMaxRows per pass). next: the first weight row this thread reads after these (another
// matrix's, with as many columns), where the prefetch runs on past n1; null: none
void gemv_block(const bf16* W, int64_t ldw, const bf16* x, int64_t ldx, int64_t M, int64_t K, bf16* out,
                int64_t ldo, int64_t n0, int64_t n1, const bf16* next = nullptr) {
  // weight rows outer, x's rows inner: a tile of weight rows stays in L1 while every row of x passes (a prefill's
  // many rows read the weight once, not once per kMaxRows)
  float y[4][kMaxRows];
  for (int64_t n = n0; n < n1;) {
    const int R = n + 4 <= n1 ? 4 : 1;
    const int64_t lead = n + kPrefetchTiles * R;  // the row kPrefetchTiles tiles on
    const char* ahead = reinterpret_cast<const char*>(lead < n1 || next == nullptr ? W + lead * ldw
                                                                                    : next + (lead - n1) * ldw);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      if (R == 4) dot_rows<4>(W + n * ldw, ldw, x + m0 * ldx, ldx, rows, K, &y[0][0], ahead);
      else dot_rows<1>(W + n * ldw, ldw, x + m0 * ldx, ldx, rows, K, &y[0][0], ahead);
      for (int r = 0; r < R; ++r)
        for (int64_t m = 0; m < rows; ++m) out[(m0 + m) * ldo + n + r] = to_bf16(y[r][m]);
    }
    n += R;
  }
}

struct Block {  // gemv_block's arguments: rows [a, b) of W times x into out
  const bf16* W;
  int64_t ldw;
  const bf16* x;
  int64_t ldx, M, K;
  bf16* out;
  int64_t ldo, a, b;
};

// one thread's blocks in order, each one's prefetch running on into the next one's first rows: the matrices a
// thread reads in turn (an expert's gate, then its up, then the next expert's gate ...) lie apart in memory, and
// each would otherwise start cold
void run_in_order(const std::vector<Block>& blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& k = blocks[i];
    const bf16* next = i + 1 < blocks.size() ? blocks[i + 1].W + blocks[i + 1].a * blocks[i + 1].ldw : nullptr;
    gemv_block(k.W, k.ldw, k.x, k.ldx, k.M, k.K, k.out, k.ldo, k.a, k.b, next);
  }
}

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16, what, ": expected a CPU bfloat16 tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": expected a 2-D tensor with contiguous rows");
}

const bf16* ptr(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }

constexpr int64_t kGrain = 16;  // weight rows per task: a few tens of KB, enough to amortize a task

}  // namespace

// x [M, K] @ W[N, K]^T -> [M, N], bfloat16 in and out, fp32 accumulation
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& W) {
  check_bf16(x, "x");
  check_bf16(W, "weight");
  TORCH_CHECK(x.size(1) == W.size(1), "x has ", x.size(1), " columns, the weight ", W.size(1));
  const int64_t M = x.size(0), N = W.size(0), K = W.size(1);
  auto out = torch::empty({M, N}, x.options());
  bf16* o = reinterpret_cast<bf16*>(out.data_ptr());
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    gemv_block(ptr(W), W.stride(0), ptr(x), x.stride(0), M, K, o, N, n0, n1);
  });
  return out;
}

// x [M, K] @ W_i[N_i, K]^T for several weights of one input (an attention's q, k and v) in one parallel region:
// each output is linear()'s, bit for bit
std::vector<torch::Tensor> linears(const torch::Tensor& x, const std::vector<torch::Tensor>& Ws) {
  check_bf16(x, "x");
  const int64_t P = static_cast<int64_t>(Ws.size()), M = x.size(0), K = x.size(1);
  std::vector<torch::Tensor> out(P);
  std::vector<int64_t> first(P + 1, 0);
  for (int64_t i = 0; i < P; ++i) {
    check_bf16(Ws[i], "weight");
    TORCH_CHECK(Ws[i].size(1) == K, "x has ", K, " columns, weight ", i, " ", Ws[i].size(1));
    out[i] = torch::empty({M, Ws[i].size(0)}, x.options());
    first[i + 1] = first[i] + Ws[i].size(0);
  }
  at::parallel_for(0, first[P], kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<Block> blocks;
    for (int64_t i = 0; i < P && r0 < r1; ++i) {
      const int64_t a = std::max(r0, first[i]), b = std::min(r1, first[i + 1]);
      if (a >= b) continue;
      const auto& W = Ws[i];
      blocks.push_back({ptr(W), W.stride(0), ptr(x), x.stride(0), M, K, reinterpret_cast<bf16*>(out[i].data_ptr()),
                        W.size(0), a - first[i], b - first[i]});
    }
    run_in_order(blocks);
  });
  return out;
}

PlainMatrix plain_matrix(const torch::Tensor& W, const char* what, int64_t e) {
  TORCH_CHECK(W.device().is_cpu() && W.scalar_type() == torch::kBFloat16 && W.dim() == 2 && W.stride(1) == 1, what,
              " of expert ", e, ": expected a 2-D CPU bfloat16 tensor with contiguous rows");
  return {ptr(W), W.size(0), W.size(1), W.stride(0)};
}

// Routed experts with a gated SiLU MLP, as runtime/arch/base.expert_forward computes them in bf16 with the same
// roundings (each product rounded to bf16, silu(g) rounded, then g*u rounded, the down product rounded, then the
// routing weight applied and rounded): part_e = w_e * down_e(silu(gate_e x_e) * (up_e x_e)), into rows[e].out.
// Two parallel regions: every gate and up row, each thread then taking silu(g) * u of the rows it made; every down
// row, each thread then applying the routing weights to the rows it made. The scratch is the calling thread's,
// kept between calls of up to kKeptRows rows.
void run_experts_plain(const std::vector<const ExpertForms*>& forms, const std::vector<ExpertRows>& rows) {
  const int64_t E = static_cast<int64_t>(forms.size());
  thread_local std::vector<bf16> scratch_tl;  // per expert: g, u and h [M, I] each, at[e]
  std::vector<bf16>& scratch = scratch_tl;
  std::vector<int64_t> first_gate(E + 1, 0), first_down(E + 1, 0), at(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    first_gate[e + 1] = first_gate[e] + forms[e]->inter;
    first_down[e + 1] = first_down[e] + forms[e]->down.N;
    at[e + 1] = at[e] + 3 * rows[e].M * forms[e]->inter;
  }
  if (static_cast<int64_t>(scratch.size()) < at[E]) scratch.resize(at[E]);
  auto g_of = [&](int64_t e) { return scratch.data() + at[e]; };
  auto u_of = [&](int64_t e) { return scratch.data() + at[e] + rows[e].M * forms[e]->inter; };
  auto h_of = [&](int64_t e) { return scratch.data() + at[e] + 2 * rows[e].M * forms[e]->inter; };
  struct Span {  // rows [a, b) of expert e's projection
    int64_t e, a, b;
  };
  // the spans of each expert's rows (prefix sums `first`) that this thread's range [r0, r1) covers
  auto spans_of = [&](const std::vector<int64_t>& first, int64_t r0, int64_t r1) {
    std::vector<Span> spans;
    for (int64_t e = 0; e < E && r0 < r1; ++e) {
      const int64_t a = std::max(r0, first[e]), b = std::min(r1, first[e + 1]);
      if (a < b) spans.push_back({e, a - first[e], b - first[e]});
    }
    return spans;
  };
  at::parallel_for(0, first_gate[E], kGrain, [&](int64_t r0, int64_t r1) {
    const auto spans = spans_of(first_gate, r0, r1);
    std::vector<Block> blocks;
    for (const Span& s : spans) {
      const ExpertRows& x = rows[s.e];
      const ExpertForms& f = *forms[s.e];
      blocks.push_back({f.gate.W, f.gate.ld, x.x, x.ldx, x.M, f.gate.K, g_of(s.e), f.inter, s.a, s.b});
      blocks.push_back({f.up.W, f.up.ld, x.x, x.ldx, x.M, f.up.K, u_of(s.e), f.inter, s.a, s.b});
    }
    run_in_order(blocks);
    for (const Span& s : spans) {  // h = bf16(bf16(silu(g)) * u) of these rows
      const int64_t I = forms[s.e]->inter;
      const bf16 *g = g_of(s.e), *u = u_of(s.e);
      bf16* h = h_of(s.e);
      for (int64_t m = 0; m < rows[s.e].M; ++m)
        for (int64_t i = m * I + s.a; i < m * I + s.b; ++i) h[i] = offload_native::silu_times(g[i], u[i]);
    }
  });
  at::parallel_for(0, first_down[E], kGrain, [&](int64_t r0, int64_t r1) {
    const auto spans = spans_of(first_down, r0, r1);
    std::vector<Block> blocks;
    for (const Span& s : spans) {
      const ExpertRows& x = rows[s.e];
      const ExpertForms& f = *forms[s.e];
      blocks.push_back({f.down.W, f.down.ld, h_of(s.e), f.inter, x.M, f.inter, x.out, x.ldo, s.a, s.b});
    }
    run_in_order(blocks);
    for (const Span& s : spans) {
      const ExpertRows& x = rows[s.e];
      offload_native::weigh_rows(x.out, x.ldo, x.M, x.weight, x.weight_step, s.a, s.b);
    }
  });
  if (!keeps_scratch(rows)) std::vector<bf16>().swap(scratch);
}

// run_experts_plain over tensors (experts_on): xs[e] [M_e, K] the tokens routed to expert e; gates/ups [I, K];
// downs [H, I]; weights[e]: M_e bf16 routing weights -> each expert's part
std::vector<torch::Tensor> experts(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& gates,
                                   const std::vector<torch::Tensor>& ups, const std::vector<torch::Tensor>& downs,
                                   const std::vector<torch::Tensor>& weights) {
  TORCH_CHECK(gates.size() == xs.size() && ups.size() == xs.size() && downs.size() == xs.size(),
              "one x, gate, up, down and weight per expert");
  std::vector<ExpertForms> forms;
  for (size_t e = 0; e < xs.size(); ++e)
    forms.push_back(expert_forms({gates[e]}, {ups[e]}, {downs[e]}, static_cast<int64_t>(e)));
  return experts_on(xs, forms, weights);
}
