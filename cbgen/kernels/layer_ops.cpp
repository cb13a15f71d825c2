// Small fused ops for the decoder-layer fast path (cbgen/fast_forward.py).
//
// At 64 decode rows SmolLM2's hidden state is 64 x 576 floats: an RMSNorm or a
// rotary embedding over it is a few microseconds of arithmetic, but written as
// transformers writes them (pow, mean, add, rsqrt, mul, mul; mul, slice, neg,
// cat, mul, add per tensor) each is half a dozen torch calls, and with 30 layers
// those calls cost more than the arithmetic by far. Each op here is one call.
//
// Results follow transformers' formulas operation by operation: every product is
// rounded before it is summed (the build passes -ffp-contract=off, so the compiler
// fuses nothing into an FMA), which makes the rotary embedding bitwise identical
// to apply_rotary_pos_emb. The RMSNorm's sum of squares is accumulated in double:
// torch's own float reduction adds in an order that changes with the number of
// rows (so LlamaRMSNorm itself gives a row other bits in another batch), and the
// variance here is the correctly rounded one, within an ulp of torch's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [rows, width] with contiguous rows");
}

// Rows per task: a 64-row decode batch splits over two threads (add_rms_norm:
// 15 -> 10 us a call; a single thread below 32 rows, where a split costs more).
constexpr int64_t kRowGrain = 32;

}  // namespace

// residual += delta (when given, in place); returns weight * residual / rms(residual),
// row by row, as transformers' LlamaRMSNorm computes it in float32.
at::Tensor add_rms_norm(const at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == width,
              "weight must be a contiguous float32 vector of the hidden size");
  const float* d_ptr = nullptr;
  int64_t d_stride = 0;
  if (delta.has_value()) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == rows && delta->size(1) == width, "delta and residual differ");
    d_ptr = delta->data_ptr<float>();
    d_stride = delta->stride(0);
  }
  auto out = at::empty({rows, width}, residual.options());
  float* r_ptr = residual.data_ptr<float>();
  const int64_t r_stride = residual.stride(0);
  const float* w = weight.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* x = r_ptr + i * r_stride;
      if (d_ptr != nullptr) {
        const float* d = d_ptr + i * d_stride;
        for (int64_t j = 0; j < width; ++j) x[j] = x[j] + d[j];
      }
      // Eight running sums, not one: a single chain of dependent double adds cost
      // 0.26 ms a call at 512 rows. In double the order changes nothing a float
      // variance can show.
      double partial[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      int64_t j = 0;
      for (; j + 8 <= width; j += 8) {
        for (int k = 0; k < 8; ++k) {
          const float square = x[j + k] * x[j + k];
          partial[k] += square;
        }
      }
      double squares = 0.0;
      for (; j < width; ++j) {
        const float square = x[j] * x[j];
        squares += square;
      }
      for (int k = 0; k < 8; ++k) squares += partial[k];
      const float variance = static_cast<float>(squares / static_cast<double>(width));
      const float inv = 1.0f / std::sqrt(variance + feps);
      float* o = o_ptr + i * width;
      for (int64_t j = 0; j < width; ++j) o[j] = w[j] * (x[j] * inv);
    }
  });
  return out;
}

// qkv: [tokens, (heads + 2 * kv_heads) * dim], the fused q/k/v projection (rows
// contiguous); cos, sin: [tokens, dim]. Applies the rotary embedding as
// transformers' apply_rotary_pos_emb does (x * cos + rotate_half(x) * sin, with
// rotate_half(x) = cat(-x2, x1)): to the queries into a new [tokens, heads, dim]
// tensor, which is returned, and to the keys in place. Values are left alone.
//
// With key_cache/value_cache ([kv_heads, blocks, block_size, dim], contiguous)
// and slots ([tokens] int64 flat slots), each token's rotated keys and its values
// are also stored at its slot: the paged cache write, without a second pass.
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& key_cache,
                    const c10::optional<at::Tensor>& value_cache,
                    const c10::optional<at::Tensor>& slots) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous and the same shape");
  const int64_t tokens = qkv.size(0), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && cos.size(0) == tokens, "cos/sin must be [tokens, even dim]");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv width is not (heads + 2 kv) * dim");
  const bool store = key_cache.has_value();
  TORCH_CHECK(store == value_cache.has_value() && store == slots.has_value(),
              "give key_cache, value_cache and slots together");
  float* k_cache = nullptr;
  float* v_cache = nullptr;
  int64_t cache_head_stride = 0;
  const int64_t* slot_ptr = nullptr;
  if (store) {
    for (const at::Tensor* cache : {&*key_cache, &*value_cache}) {
      TORCH_CHECK(cache->scalar_type() == at::kFloat && cache->is_contiguous() &&
                      cache->dim() == 4 && cache->size(0) == kv_heads && cache->size(3) == dim,
                  "caches must be contiguous float32 [kv_heads, blocks, block_size, dim]");
      TORCH_CHECK(cache->sizes() == key_cache->sizes(), "key and value caches differ");
    }
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() &&
                    slots->numel() == tokens,
                "slots must be contiguous int64, one per token");
    cache_head_stride = key_cache->stride(0);
    const int64_t capacity = key_cache->size(1) * key_cache->size(2);
    slot_ptr = slots->data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < capacity, "slot ", slot_ptr[t],
                  " is outside the cache");
    }
    k_cache = key_cache->data_ptr<float>();
    v_cache = value_cache->data_ptr<float>();
  }
  auto q = at::empty({tokens, heads, dim}, qkv.options());
  float* src_ptr = qkv.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  const float* c_ptr = cos.data_ptr<float>();
  const float* s_ptr = sin.data_ptr<float>();
  float* q_ptr = q.data_ptr<float>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = c_ptr + t * dim;
      const float* s = s_ptr + t * dim;
      float* row = src_ptr + t * stride;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = row + h * dim;
        float* y = h < heads ? q_ptr + (t * heads + h) * dim : x;
        for (int64_t j = 0; j < half; ++j) {
          const float lo = x[j], hi = x[j + half];
          const float lo_cos = lo * c[j], hi_sin = hi * s[j];
          const float hi_cos = hi * c[j + half], lo_sin = lo * s[j + half];
          y[j] = lo_cos - hi_sin;  // lo * cos + (-hi) * sin, the same rounding
          y[j + half] = hi_cos + lo_sin;
        }
      }
      if (store) {
        const int64_t offset = slot_ptr[t] * dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          std::memcpy(k_cache + h * cache_head_stride + offset, row + (heads + h) * dim,
                      dim * sizeof(float));
          std::memcpy(v_cache + h * cache_head_stride + offset,
                      row + (heads + kv_heads + h) * dim, dim * sizeof(float));
        }
      }
    }
  });
  return q;
}
