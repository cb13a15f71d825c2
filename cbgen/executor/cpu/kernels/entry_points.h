// The kernels' entry points that another source calls besides Python: bindings.cpp
// binds them, layer_stack.cpp runs a decoder's layers through them.
#pragma once

#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window, double softcap,
                                  const c10::optional<at::Tensor>& sinks);
at::Tensor add_rms_norm(const at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps,
                        c10::optional<at::ScalarType> out_dtype);
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& key_cache,
                    const c10::optional<at::Tensor>& value_cache,
                    const c10::optional<at::Tensor>& slots, int64_t head_dim);
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate);
at::Tensor int4_vnni_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima);
at::Tensor int4_avx2_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima);
at::Tensor int4_bf16_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima);
at::Tensor int8_rows_matmul(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales);
at::Tensor bf16_rows_matmul(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias);
