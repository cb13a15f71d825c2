// Paged decode attention for CPU: one query token per sequence, read straight
// from the block tables. Each (sequence, KV head) pair is one work item: its
// group of query heads scores every cached token once, so K and V are read
// once per layer, with no gathered copy and no padding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  float lanes[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      lanes[j] += q[d + j] * static_cast<float>(k[d + j]);
    }
  }
  float sum = 0.f;
  for (; d < dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

template <typename scalar_t>
void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
            double scale, int64_t sliding_window, double softcap) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0);
  const int64_t num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t value_dim = value_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_f(group * head_dim);
    std::vector<float> scores;
    std::vector<float> acc(group * value_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads;
      const int64_t kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t span = len - first;
      const int64_t* table = tables + seq * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_f[g * head_dim + d] = static_cast<float>(src[d]);
      }
      scores.assign(group * span, 0.f);
      const scalar_t* k_head = k_ptr + kv_head * num_blocks * block_size * head_dim;
      for (int64_t t = first; t < len; ++t) {
        const scalar_t* k = k_head + (table[t / block_size] * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          float s = dot(q_f.data() + g * head_dim, k, head_dim) * fscale;
          if (fcap > 0.f) s = std::tanh(s / fcap) * fcap;
          scores[g * span + (t - first)] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * span;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < span; ++i) max_score = std::max(max_score, row[i]);
        float total = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          row[i] = std::exp(row[i] - max_score);
          total += row[i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < span; ++i) row[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const scalar_t* v_head = v_ptr + kv_head * num_blocks * block_size * value_dim;
      for (int64_t t = first; t < len; ++t) {
        const scalar_t* v = v_head + (table[t / block_size] * block_size + t % block_size) * value_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * span + (t - first)];
          float* a = acc.data() + g * value_dim;
          for (int64_t d = 0; d < value_dim; ++d) a[d] += p * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_ptr + (seq * num_heads + kv_head * group + g) * value_dim;
        for (int64_t d = 0; d < value_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * value_dim + d]);
      }
    }
  });
}

}  // namespace

// query [seqs, heads, dim]; caches [kv_heads, blocks, block_size, dim];
// block_tables [seqs, width] int64; context_lens [seqs] int64.
// sliding_window <= 0 means none; softcap <= 0 means none.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0, "heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty({query.size(0), query.size(1), value_cache.size(3)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(query, key_cache, value_cache, tables, lens, out, scale, sliding_window,
                     softcap);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
