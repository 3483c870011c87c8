// The small steps of a one-token decode step around the matmuls, one native call each instead of ~10-30 torch ops
// (each ~2-5 us of dispatch and Python on a CPU, several hundred per token: docs/PERF.md).
//
// attend_one: a standard attention layer's work between its q/k/v projections and its output projection for one
//   query (runtime/arch/base.StandardOps.attention's decode step): per-head QK RMSNorm, rotate-half RoPE from the
//   step's cos/sin tables, the new K/V written into the cache's bf16 buffers, and softmax attention over every
//   cached position with grouped KV heads. Roundings follow the torch path (each bf16 op rounded, norms and
//   attention in fp32); the sums' order is fixed, so the bits do not depend on threads.
// rms_norm_rows: the RMSNorm of a few rows, as layers.rms_norm rounds it.
// combine_add: x + (sum of the experts' parts in the order given, each addition rounded to bf16) + shared, bit for
//   bit what runtime/moe.combine and the residual add compute for one row.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "bf16_util.h"

namespace {

using offload_native::bf16;
using offload_native::to_bf16;
using offload_native::to_float;

const bf16* cptr(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* mptr(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

void check(const torch::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous(), what,
              ": expected a contiguous CPU bfloat16 tensor");
  TORCH_CHECK(numel < 0 || t.numel() == numel, what, ": expected ", numel, " values, got ", t.numel());
}

// sum_i term(i) in 8 partial sums reduced in a fixed order: a loop the compiler vectorizes (one running sum stays
// scalar: reordering it is not allowed without -ffast-math), the same bits in every build (no contraction)
template <typename Term>
inline float sum8(int64_t n, Term term) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += term(i + l);
  for (; i < n; ++i) part[i % 8] += term(i);
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// layers.rms_norm on one head's D values, in place: fp32 mean of squares, x * rsqrt rounded, times the weight
void rms_norm_head(bf16* x, const bf16* w, int64_t D, float eps) {
  const float ss = sum8(D, [&](int64_t i) { return to_float(x[i]) * to_float(x[i]); });
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) x[i] = to_bf16(to_float(w[i]) * to_float(to_bf16(to_float(x[i]) * r)));
}

// layers.apply_rotary (rotate-half, full head): x*cos + rotate_half(x)*sin, each product and the sum rounded
void rope_head(bf16* x, const bf16* cos, const bf16* sin, int64_t D) {
  const int64_t half = D / 2;
  bf16 out[512];
  auto rotate = [&](int64_t i, float rotated) {
    const float a = to_float(to_bf16(to_float(x[i]) * to_float(cos[i])));
    const float b = to_float(to_bf16(rotated * to_float(sin[i])));
    out[i] = to_bf16(a + b);
  };
  for (int64_t i = 0; i < half; ++i) rotate(i, -to_float(x[i + half]));  // two branch-free loops: vectorized
  for (int64_t i = half; i < D; ++i) rotate(i, to_float(x[i - half]));
  std::copy(out, out + D, x);
}

}  // namespace

// q [1, Hq*D], k/v [1, Hkv*D] (bf16, projected); q_norm / k_norm [D] or empty; cos / sin [1, D];
// k_cache / v_cache [capacity, Hkv, D] bf16: the new entry goes to position `start`, attention covers 0..start
// -> [1, Hq*D] bf16
torch::Tensor attend_one(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                         const std::optional<torch::Tensor>& q_norm, const std::optional<torch::Tensor>& k_norm,
                         double eps, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t start, double scale) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "k/v cache: expected [capacity, heads, dim]");
  const int64_t Hkv = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && D > 0 && D <= 512 && D % 2 == 0, "k/v cache: expected heads > 0 and an even head dim <= 512");
  const int64_t Hq = q_in.numel() / D;
  TORCH_CHECK(Hq % Hkv == 0 && Hq * D == q_in.numel(), "q: not a whole number of heads per KV head");
  TORCH_CHECK(start >= 0 && start < k_cache.size(0), "position ", start, " is outside the cache");
  check(q_in, "q", Hq * D);
  check(k_in, "k", Hkv * D);
  check(v_in, "v", Hkv * D);
  check(cos, "cos", D);
  check(sin, "sin", D);
  check(k_cache, "k_cache", -1);
  check(v_cache, "v_cache", -1);
  if (q_norm) check(*q_norm, "q_norm", D);
  if (k_norm) check(*k_norm, "k_norm", D);
  auto q = q_in.clone();
  bf16* qp = mptr(q);
  bf16* kslot = mptr(k_cache) + start * Hkv * D;
  std::copy(cptr(k_in), cptr(k_in) + Hkv * D, kslot);
  std::copy(cptr(v_in), cptr(v_in) + Hkv * D, mptr(v_cache) + start * Hkv * D);
  const float e = static_cast<float>(eps);
  for (int64_t h = 0; h < Hq; ++h) {
    if (q_norm) rms_norm_head(qp + h * D, cptr(*q_norm), D, e);
    rope_head(qp + h * D, cptr(cos), cptr(sin), D);
  }
  for (int64_t h = 0; h < Hkv; ++h) {
    if (k_norm) rms_norm_head(kslot + h * D, cptr(*k_norm), D, e);
    rope_head(kslot + h * D, cptr(cos), cptr(sin), D);
  }
  auto out = torch::empty({1, Hq * D}, q_in.options());
  const int64_t S = start + 1, group = Hq / Hkv;
  const bf16* kc = cptr(k_cache);
  const bf16* vc = cptr(v_cache);
  bf16* op = mptr(out);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, Hq, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> p(S), qf(D), acc(D);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < D; ++i) qf[i] = to_float(qp[h * D + i]);
      float m = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        const bf16* kr = kc + (s * Hkv + kvh) * D;
        p[s] = sum8(D, [&](int64_t i) { return qf[i] * to_float(kr[i]); }) * sc;
        m = std::max(m, p[s]);
      }
      float l = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        p[s] = std::exp(p[s] - m);
        l += p[s];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const bf16* vr = vc + (s * Hkv + kvh) * D;
        for (int64_t i = 0; i < D; ++i) acc[i] += p[s] * to_float(vr[i]);
      }
      for (int64_t i = 0; i < D; ++i) op[h * D + i] = to_bf16(acc[i] / l);
    }
  });
  return out;
}

// layers.rms_norm over each row of x [M, H] (the layers' input and post-attention norms of a decode step), with
// rms_norm_head's arithmetic: one call instead of torch's four ops (~30 us for one row on 2 threads)
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2, "x: expected [rows, hidden], got ", x.dim(), " dimensions");
  check(x, "x", -1);
  check(weight, "norm weight", x.size(1));
  auto out = x.clone();
  for (int64_t m = 0; m < x.size(0); ++m)
    rms_norm_head(mptr(out) + m * x.size(1), cptr(weight), x.size(1), static_cast<float>(eps));
  return out;
}

// x [1, H] + combine(parts) (+ shared): the parts summed in the order given (the caller's ascending expert order)
// from zero, each addition rounded to bf16, then the shared experts' output added, then the residual
void combine_rows(const bf16* x, const std::vector<const bf16*>& parts, const bf16* shared, bf16* out, int64_t H) {
  // one pass over the row per part (each a loop the compiler vectorizes), the running sum rounded as it goes
  thread_local std::vector<float> acc;
  acc.assign(H, 0.f);
  float* a = acc.data();
  auto add = [&](const bf16* p) {
    for (int64_t j = 0; j < H; ++j) a[j] = to_float(to_bf16(a[j] + to_float(p[j])));
  };
  for (const bf16* p : parts) add(p);
  if (shared != nullptr) add(shared);
  for (int64_t j = 0; j < H; ++j) out[j] = to_bf16(to_float(x[j]) + a[j]);
}

torch::Tensor combine_add(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                          const std::optional<torch::Tensor>& shared) {
  const int64_t H = x.numel();
  check(x, "x", H);
  std::vector<const bf16*> rows;
  for (const auto& p : parts) {
    check(p, "part", H);
    rows.push_back(cptr(p));
  }
  if (shared) check(*shared, "shared", H);
  auto out = torch::empty_like(x);
  combine_rows(cptr(x), rows, shared ? cptr(*shared) : nullptr, mptr(out), H);
  return out;
}
