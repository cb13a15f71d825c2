// Small fused ops for the decoder-layer fast path (cbgen/executor/cpu/fast_forward.py).
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
#include <type_traits>

#include "simd.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [rows, width] with contiguous rows");
}

// Rows per task: a 64-row decode batch splits over two threads (add_rms_norm:
// 15 -> 10 us a call; a single thread below 32 rows, where a split costs more).
constexpr int64_t kRowGrain = 32;

// Calls f with a null pointer of the C++ type of `type` (float or bfloat16), so one
// template serves every mix of dtypes the bfloat16 fast path passes.
template <typename F>
void with_type(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(type == at::kFloat, "expected float32 or bfloat16, got ", type);
    f(static_cast<float*>(nullptr));
  }
}

template <typename D, typename W, typename O>
void add_rms_norm_rows(float* r_ptr, int64_t r_stride, const D* d_ptr, int64_t d_stride,
                       const W* w, O* o_ptr, int64_t rows, int64_t width, float feps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* x = r_ptr + i * r_stride;
      if (d_ptr != nullptr) {
        const D* d = d_ptr + i * d_stride;
        for (int64_t j = 0; j < width; ++j) x[j] = x[j] + static_cast<float>(d[j]);
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
      O* o = o_ptr + i * width;
      for (int64_t j = 0; j < width; ++j) {
        o[j] = static_cast<O>(static_cast<float>(w[j]) * (x[j] * inv));
      }
    }
  });
}

}  // namespace

// residual += delta (when given, in place); returns weight * residual / rms(residual),
// row by row, as transformers' LlamaRMSNorm computes it in float32.
//
// The residual stream is always float32. For the bfloat16 fast path delta (a GEMM's
// output) and weight may be bfloat16 and the result is returned in `out_dtype`
// (bfloat16: the next GEMM's input): the sums and the product run in float32 and
// only the result is rounded, where transformers' bfloat16 modules round the
// residual itself after every add.
at::Tensor add_rms_norm(const at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps,
                        c10::optional<at::ScalarType> out_dtype) {
  check_rows(residual, "residual");
  TORCH_CHECK(residual.scalar_type() == at::kFloat, "the residual must be float32");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == width,
              "weight must be a contiguous vector of the hidden size");
  int64_t d_stride = 0;
  if (delta.has_value()) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == rows && delta->size(1) == width, "delta and residual differ");
    d_stride = delta->stride(0);
  }
  const at::ScalarType out_type = out_dtype.value_or(at::kFloat);
  auto out = at::empty({rows, width}, residual.options().dtype(out_type));
  float* r_ptr = residual.data_ptr<float>();
  const int64_t r_stride = residual.stride(0);
  const float feps = static_cast<float>(eps);
  const at::ScalarType delta_type = delta.has_value() ? delta->scalar_type() : at::kFloat;
  with_type(delta_type, [&](auto* d_tag) {
    using D = std::remove_pointer_t<decltype(d_tag)>;
    const D* d_ptr = delta.has_value() ? delta->data_ptr<D>() : nullptr;
    with_type(weight.scalar_type(), [&](auto* w_tag) {
      using W = std::remove_pointer_t<decltype(w_tag)>;
      with_type(out_type, [&](auto* o_tag) {
        using O = std::remove_pointer_t<decltype(o_tag)>;
        add_rms_norm_rows<D, W, O>(r_ptr, r_stride, d_ptr, d_stride, weight.data_ptr<W>(),
                                   out.data_ptr<O>(), rows, width, feps);
      });
    });
  });
  return out;
}

namespace {

template <typename Q, typename C>
void rope_rows(Q* src_ptr, int64_t stride, const float* c_ptr, const float* s_ptr, C* q_ptr,
               int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t rotary,
               C* k_cache, C* v_cache, int64_t cache_head_stride, const int64_t* slot_ptr) {
  const int64_t half = rotary / 2;
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = c_ptr + t * rotary;
      const float* s = s_ptr + t * rotary;
      Q* row = src_ptr + t * stride;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        Q* x = row + h * dim;
        int64_t j = 0;
#if CBGEN_VFLOAT
        // bfloat16 in and out: the same products and sums as the loop below, kWidth at a
        // time (an explicit multiply and subtract: nothing fused), rounded as it rounds.
        if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
          C* y = h < heads ? q_ptr + (t * heads + h) * dim : x;
          for (; j + kWidth <= half; j += kWidth) {
            const vfloat lo = vload_bf16(x + j), hi = vload_bf16(x + j + half);
            const vfloat y_lo = vsub(vmul(lo, vload(c + j)), vmul(hi, vload(s + j)));
            const vfloat y_hi = vadd(vmul(hi, vload(c + j + half)), vmul(lo, vload(s + j + half)));
            vstore_bf16(y + j, y_lo);
            vstore_bf16(y + j + half, y_hi);
          }
        }
#endif
        for (; j < half; ++j) {
          const float lo = static_cast<float>(x[j]), hi = static_cast<float>(x[j + half]);
          const float lo_cos = lo * c[j], hi_sin = hi * s[j];
          const float hi_cos = hi * c[j + half], lo_sin = lo * s[j + half];
          const float y_lo = lo_cos - hi_sin;  // lo * cos + (-hi) * sin, the same rounding
          const float y_hi = hi_cos + lo_sin;
          if (h < heads) {
            C* y = q_ptr + (t * heads + h) * dim;
            y[j] = static_cast<C>(y_lo);
            y[j + half] = static_cast<C>(y_hi);
          } else {
            x[j] = static_cast<Q>(y_lo);
            x[j + half] = static_cast<Q>(y_hi);
          }
        }
        // A rotary embedding over part of the head (Phi-4-mini): the rest passes as it
        // is, into the queries' new tensor (the keys' stay in place).
        if (h < heads) {
          C* y = q_ptr + (t * heads + h) * dim;
          for (int64_t i = rotary; i < dim; ++i) y[i] = static_cast<C>(static_cast<float>(x[i]));
        }
      }
      if (k_cache != nullptr) {
        const int64_t offset = slot_ptr[t] * dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const Q* k = row + (heads + h) * dim;
          const Q* v = row + (heads + kv_heads + h) * dim;
          C* k_dst = k_cache + h * cache_head_stride + offset;
          C* v_dst = v_cache + h * cache_head_stride + offset;
          if constexpr (std::is_same_v<Q, C>) {
            std::memcpy(k_dst, k, dim * sizeof(C));
            std::memcpy(v_dst, v, dim * sizeof(C));
          } else {
            for (int64_t j = 0; j < dim; ++j) {
              k_dst[j] = static_cast<C>(static_cast<float>(k[j]));
              v_dst[j] = static_cast<C>(static_cast<float>(v[j]));
            }
          }
        }
      }
    }
  });
}

}  // namespace

// qkv: [tokens, (heads + 2 * kv_heads) * dim], the fused q/k/v projection (rows
// contiguous); cos, sin: [tokens, rotary] float32, rotary = dim unless head_dim gives
// dim apart (a rotary embedding over the first `rotary` of each head's dim, as
// apply_rotary_pos_emb does when cos is narrower than the head). Applies the rotary embedding as
// transformers' apply_rotary_pos_emb does (x * cos + rotate_half(x) * sin, with
// rotate_half(x) = cat(-x2, x1)): to the queries into a new [tokens, heads, dim]
// tensor, which is returned, and to the keys in place. Values are left alone.
//
// With key_cache/value_cache ([kv_heads, blocks, block_size, dim], contiguous)
// and slots ([tokens] int64 flat slots), each token's rotated keys and its values
// are also stored at its slot: the paged cache write, without a second pass.
// qkv and the caches may each be float32 or bfloat16 (a bfloat16 cache under
// float32 weights): the arithmetic is float32, and the queries come back in the
// cache's dtype (qkv's without a cache), which is what the attention kernel reads.
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& key_cache,
                    const c10::optional<at::Tensor>& value_cache,
                    const c10::optional<at::Tensor>& slots, int64_t head_dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous and the same shape");
  const int64_t tokens = qkv.size(0), rotary = cos.size(1);
  const int64_t dim = head_dim > 0 ? head_dim : rotary;
  TORCH_CHECK(rotary % 2 == 0 && rotary <= dim && cos.size(0) == tokens,
              "cos/sin must be [tokens, an even width up to head_dim]");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv width is not (heads + 2 kv) * dim");
  const bool store = key_cache.has_value();
  TORCH_CHECK(store == value_cache.has_value() && store == slots.has_value(),
              "give key_cache, value_cache and slots together");
  int64_t cache_head_stride = 0;
  const int64_t* slot_ptr = nullptr;
  at::ScalarType cache_type = qkv.scalar_type();
  if (store) {
    cache_type = key_cache->scalar_type();
    for (const at::Tensor* cache : {&*key_cache, &*value_cache}) {
      TORCH_CHECK((cache->scalar_type() == at::kFloat || cache->scalar_type() == at::kBFloat16) &&
                      cache->scalar_type() == cache_type && cache->is_contiguous() &&
                      cache->dim() == 4 && cache->size(0) == kv_heads && cache->size(3) == dim,
                  "caches must be contiguous float32 or bfloat16 [kv_heads, blocks, block_size, dim]");
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
  }
  auto q = at::empty({tokens, heads, dim}, qkv.options().dtype(cache_type));
  with_type(qkv.scalar_type(), [&](auto* q_tag) {
    using Q = std::remove_pointer_t<decltype(q_tag)>;
    with_type(cache_type, [&](auto* c_tag) {
      using C = std::remove_pointer_t<decltype(c_tag)>;
      rope_rows<Q, C>(qkv.data_ptr<Q>(), qkv.stride(0), cos.data_ptr<float>(),
                      sin.data_ptr<float>(), q.data_ptr<C>(), tokens, heads, kv_heads, dim, rotary,
                      store ? key_cache->data_ptr<C>() : nullptr,
                      store ? value_cache->data_ptr<C>() : nullptr, cache_head_stride, slot_ptr);
    });
  });
  return q;
}

// gate_up: bfloat16 [tokens, 2 * intermediate] (rows contiguous), the fused gate/up
// projection. Returns bfloat16 [tokens, intermediate] = silu(gate) * up, computed in
// float32 and rounded once. The bfloat16 fast path took two torch calls a layer for
// this (silu, then an in-place multiply, each rounding to bfloat16): 1.5-2 ms of a
// 64-row SmolLM2 step. float32 models keep torch's silu, whose exp this does not
// reproduce to the bit.
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.dim() == 2 && gate_up.stride(1) == 1,
              "gate_up must be a bfloat16 CPU tensor [rows, width] with contiguous rows");
  TORCH_CHECK(intermediate > 0 && gate_up.size(1) == 2 * intermediate,
              "gate_up must be [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), stride = gate_up.stride(0);
  auto out = at::empty({rows, intermediate}, gate_up.options());
  const c10::BFloat16* src = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const c10::BFloat16* gate = src + i * stride;
      const c10::BFloat16* up = gate + intermediate;
      c10::BFloat16* y = dst + i * intermediate;
      int64_t j = 0;
#if CBGEN_VFLOAT
      // silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) <= 1 so that exp
      // never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
      const vfloat one = vset1(1.f);
      for (; j + kWidth <= intermediate; j += kWidth) {
        const vfloat g = vload_bf16(gate + j);
        const vfloat e = vexp(vneg_abs(g));
        const vfloat numerator = vwhere_negative(g, e, one);
        const vfloat silu = vdiv(vmul(g, numerator), vadd(one, e));
        vstore_bf16(y + j, vmul(silu, vload_bf16(up + j)));
      }
#endif
      for (; j < intermediate; ++j) {
        const float g = static_cast<float>(gate[j]);
        y[j] = static_cast<c10::BFloat16>(g / (1.f + std::exp(-g)) * static_cast<float>(up[j]));
      }
    }
  });
  return out;
}
