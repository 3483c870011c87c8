// A one-token decode step through every layer of a standard MoE model whose weights are all resident (pinned:
// their kernel forms never move), in one call: per layer attention_block, the router's softmax / top-k and
// moe_row, composed in the order runtime/model.CausalLM._layers calls them, so the bits are that loop's. What it
// saves is the Python between the blocks (~2.5-3 ms a token on the bench model, docs/PERF.md), which a
// resident step otherwise spends beside ~5-10 ms of kernels.
#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "ops.h"

void DecodePlan::add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                           const std::vector<std::vector<torch::Tensor>>& qkv,
                           const std::optional<torch::Tensor>& q_norm, const std::optional<torch::Tensor>& k_norm,
                           const std::vector<torch::Tensor>& o_proj, const std::vector<torch::Tensor>& router,
                           const std::vector<std::vector<torch::Tensor>>& gates,
                           const std::vector<std::vector<torch::Tensor>>& ups,
                           const std::vector<std::vector<torch::Tensor>>& downs) {
  TORCH_CHECK(!router.empty(), "DecodePlan: layer ", layers_.size(), " has no router (a dense layer)");
  TORCH_CHECK(!gates.empty() && gates.size() == ups.size() && gates.size() == downs.size(), "DecodePlan: layer ",
              layers_.size(), ": one gate, up and down form per expert");
  TORCH_CHECK(static_cast<int64_t>(gates.size()) >= top_k_, "DecodePlan: layer ", layers_.size(), " has ",
              gates.size(), " experts, fewer than top-k ", top_k_);
  std::vector<ExpertForms> experts;
  for (size_t e = 0; e < gates.size(); ++e)
    experts.push_back(expert_forms(gates[e], ups[e], downs[e], static_cast<int64_t>(e)));
  for (const auto& f : experts)
    TORCH_CHECK(f.quantized == experts[0].quantized, "DecodePlan: layer ", layers_.size(),
                ": experts all plain or all int");
  layers_.push_back({input_norm, post_norm, qkv, q_norm, k_norm, o_proj, router, gates, ups, downs, experts});
}

// x [1, H] -> {the last layer's output [1, H], each layer's routed experts [layers, top_k] (int64, by weight)}
std::vector<torch::Tensor> DecodePlan::run(const torch::Tensor& x, const std::vector<torch::Tensor>& k_caches,
                                           const std::vector<torch::Tensor>& v_caches, const torch::Tensor& cos,
                                           const torch::Tensor& sin, int64_t start) const {
  const int64_t L = layers();
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
              "DecodePlan.run: one k and v cache per layer (", L, ")");
  auto routed = torch::empty({L, top_k_}, torch::kLong);
  auto* routed_at = routed.data_ptr<int64_t>();
  torch::Tensor h = x;
  std::vector<int64_t> order(top_k_), slots(top_k_);
  std::vector<const ExpertForms*> picked(top_k_);
  for (int64_t l = 0; l < L; ++l) {
    const Layer& p = layers_[l];
    const auto block = attention_block(h, p.input_norm, p.post_norm, eps_, p.qkv, p.q_norm, p.k_norm, cos, sin,
                                       k_caches[l], v_caches[l], start, scale_, p.o_proj, p.router);
    // runtime/moe.softmax_topk, the same ATen ops
    const auto probs = at::softmax(block[2], -1, at::kFloat);
    auto [top, idx] = at::topk(probs, top_k_, -1);
    if (normalize_) top = top / top.sum(-1, true);
    const auto weights = top.to(block[2].scalar_type());
    const auto chosen = idx.contiguous();
    const int64_t* expert = chosen.data_ptr<int64_t>();
    std::copy(expert, expert + top_k_, routed_at + l * top_k_);
    // the experts in ascending order (moe_row sums them so), each with its place among the weights
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return expert[a] < expert[b]; });
    for (int64_t i = 0; i < top_k_; ++i) {
      const int64_t e = expert[order[i]];
      TORCH_CHECK(e >= 0 && e < static_cast<int64_t>(p.experts.size()), "DecodePlan: layer ", l,
                  " routed to expert ", e, " of ", p.experts.size());
      slots[i] = order[i];
      picked[i] = &p.experts[e];
    }
    h = moe_row_forms(block[0], block[1], weights[0], slots, picked, std::nullopt);
  }
  return {h, routed};
}
