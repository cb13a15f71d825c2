// One MoE layer's routed experts in one call, for the fast decoder's 4-bit experts
// (cbgen/executor/cpu/moe_block.py).
//
// routed_experts.route_tokens runs a layer's experts as a dozen torch calls around the
// two grouped maps (sort the token-expert pairs, count them, gather the rows, split gate
// from up, SiLU, multiply, weight, index_add), plus the Python that picks each hit
// expert's codes: on one OLMoE token that glue was about a fifth of a layer's experts,
// and a decode step pays it in every layer. Here the same steps are one call: the
// pairs sorted by expert (a counting sort, stable in token order), the rows gathered
// once, both maps through int4_grouped (one span a hit expert), silu(gate) * up as
// silu_mul computes it, and each token's expert outputs weighted and summed in
// ascending expert order, as transformers' eager loop adds them.
//
// The weighting and the sum are float32 and the result is float32: the fast decoder
// adds it to its float32 residual stream. transformers' bfloat16 modules round the
// weighted rows and every partial sum to bfloat16; this rounds nothing after the down
// map's output, which is nearer the float32 model (as the fast decoder's dense MLPs are).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

at::Tensor int4_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                        const std::vector<at::Tensor>& packed,
                        const std::vector<at::Tensor>& scales_minima, const std::string& path);
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate);

// x: bfloat16 [tokens, hidden]; index: int64 [tokens, k], the experts each token is
// routed to (an index of `experts` or more is expert parallelism's sentinel and adds
// nothing); weights: [tokens, k] float32 or bfloat16, the routing weights.
// first_*: each expert's gate/up map (int4_grouped's packed codes and scales, one entry
// an expert, gate then up in its 2 * intermediate outputs); down_*: each expert's down
// map. Returns float32 [tokens, hidden].
at::Tensor routed_int4_experts(const at::Tensor& x, const at::Tensor& index,
                               const at::Tensor& weights,
                               const std::vector<at::Tensor>& first_packed,
                               const std::vector<at::Tensor>& first_scales_minima,
                               const std::vector<at::Tensor>& down_packed,
                               const std::vector<at::Tensor>& down_scales_minima,
                               const std::string& path, int64_t intermediate) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "routed_int4_experts: x must be a bfloat16 CPU tensor [tokens, hidden]");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 2 && index.size(0) == x.size(0),
              "routed_int4_experts: index must be int64 [tokens, k]");
  TORCH_CHECK(weights.sizes() == index.sizes() &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16),
              "routed_int4_experts: weights must be float32 or bfloat16, index's shape");
  const int64_t experts = static_cast<int64_t>(first_packed.size());
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(first_scales_minima.size()) == experts &&
                  static_cast<int64_t>(down_packed.size()) == experts &&
                  static_cast<int64_t>(down_scales_minima.size()) == experts,
              "routed_int4_experts: one packed and scales_minima an expert, for both maps");
  TORCH_CHECK(intermediate > 0, "routed_int4_experts: intermediate must be positive");
  const int64_t tokens = x.size(0), k = index.size(1), hidden = x.size(1);
  const int64_t pairs = tokens * k;
  auto out = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  if (pairs == 0) return out;

  const at::Tensor index_c = index.contiguous();
  const int64_t* idx = index_c.data_ptr<int64_t>();
  std::vector<int64_t> counts(experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(idx[p] >= 0, "routed_int4_experts: a negative expert index ", idx[p]);
    if (idx[p] < experts) ++counts[idx[p]];
  }
  // Each expert's first position in the sorted pairs; then the pairs, by expert.
  std::vector<int64_t> next(experts, 0);
  int64_t taken = 0;
  for (int64_t e = 0; e < experts; ++e) {
    next[e] = taken;
    taken += counts[e];
  }
  if (taken == 0) return out;
  std::vector<int64_t> order(taken);
  for (int64_t p = 0; p < pairs; ++p) {
    if (idx[p] < experts) order[next[idx[p]]++] = p;
  }

  const at::Tensor x_c = x.contiguous();
  auto rows = at::empty({taken, hidden}, x.options());
  {
    const c10::BFloat16* src = x_c.data_ptr<c10::BFloat16>();
    c10::BFloat16* dst = rows.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < taken; ++i) {
      std::memcpy(dst + i * hidden, src + (order[i] / k) * hidden, hidden * sizeof(c10::BFloat16));
    }
  }
  std::vector<int64_t> spans;
  std::vector<at::Tensor> first_p, first_s, down_p, down_s;
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] == 0) continue;
    spans.push_back(counts[e]);
    first_p.push_back(first_packed[e]);
    first_s.push_back(first_scales_minima[e]);
    down_p.push_back(down_packed[e]);
    down_s.push_back(down_scales_minima[e]);
  }
  const at::Tensor gate_up = int4_grouped(rows, spans, first_p, first_s, path);
  TORCH_CHECK(gate_up.size(1) == 2 * intermediate,
              "routed_int4_experts: the first maps give ", gate_up.size(1), " outputs, not 2 * ",
              intermediate);
  const at::Tensor activated = silu_mul(gate_up, intermediate);
  const at::Tensor expert_out = int4_grouped(activated, spans, down_p, down_s, path);
  TORCH_CHECK(expert_out.size(1) == hidden, "routed_int4_experts: the down maps give ",
              expert_out.size(1), " outputs, not the hidden size ", hidden);

  const at::Tensor w = weights.to(at::kFloat).contiguous();
  const float* w_ptr = w.data_ptr<float>();
  const c10::BFloat16* y_ptr = expert_out.data_ptr<c10::BFloat16>();
  float* o_ptr = out.data_ptr<float>();
  // Columns split between threads; each thread adds every pair's slice of its columns in
  // the sorted (ascending expert) order. A decode token's 8 pairs are too little work to
  // split: a task is at least 32K products.
  const int64_t grain = std::max<int64_t>(64, (int64_t{1} << 15) / taken);
  at::parallel_for(0, hidden, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < taken; ++i) {
      const int64_t p = order[i];
      const float weight = w_ptr[p];
      const c10::BFloat16* y = y_ptr + i * hidden;
      float* o = o_ptr + (p / k) * hidden;
      for (int64_t j = begin; j < end; ++j) o[j] = o[j] + weight * static_cast<float>(y[j]);
    }
  });
  return out;
}
