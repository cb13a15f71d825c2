// The Python module of cbgen's CPU kernels: one extension for every source file.
#include <torch/extension.h>

#include "entry_points.h"

at::Tensor argmax_rows(const at::Tensor& logits);
bool int4_vnni_available();
std::vector<at::Tensor> int4_vnni_pack(const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& minima, bool nibbles);
bool int4_bf16_available();
std::vector<at::Tensor> int4_bf16_pack(const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& minima, bool nibbles);
bool int4_avx2_available();
at::Tensor int4_avx2_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const std::vector<at::Tensor>& packed,
                             const std::vector<at::Tensor>& scales_minima);
at::Tensor int4_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                        const std::vector<at::Tensor>& packed,
                        const std::vector<at::Tensor>& scales_minima, const std::string& path);
at::Tensor routed_int4_experts(const at::Tensor& x, const at::Tensor& index,
                               const at::Tensor& weights,
                               const std::vector<at::Tensor>& first_packed,
                               const std::vector<at::Tensor>& first_scales_minima,
                               const std::vector<at::Tensor>& down_packed,
                               const std::vector<at::Tensor>& down_scales_minima,
                               const std::string& path, int64_t intermediate);
int64_t int8_rows_limit();
bool bf16_rows_available();
bool bf16_avx2_available();
at::Tensor bf16_avx2_matmul(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias);
bool bf16_fma_available();
std::vector<double> bf16_dot_fma_rates();
at::Tensor bf16_fma_matmul(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias);
std::vector<at::Tensor> quantize_4bit(const at::Tensor& weight, int64_t group);
std::vector<at::Tensor> quantize_8bit(const at::Tensor& weight);
void bind_weight_watch(py::module_& m);
void bind_layer_stack(py::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("sliding_window"), py::arg("softcap"),
        py::arg("sinks") = py::none());
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; RMSNorm of the residual (CPU)",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"),
        py::arg("out_dtype") = py::none());
  m.def("rope_qkv", &rope_qkv, "rotary embedding of a fused q/k/v projection (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("kv_heads"),
        py::arg("key_cache") = py::none(), py::arg("value_cache") = py::none(),
        py::arg("slots") = py::none(), py::arg("head_dim") = 0);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused bfloat16 gate/up projection (CPU)",
        py::arg("gate_up"), py::arg("intermediate"));
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) of float32 [rows, vocab] (CPU)");
  m.def("int4_vnni_available", &int4_vnni_available,
        "whether int4_vnni_matmul was compiled with AVX512-VNNI");
  m.def("int4_vnni_pack", &int4_vnni_pack, "4-bit codes, scales, minima to int4_vnni_matmul's layout",
        py::arg("codes"), py::arg("scales"), py::arg("minima"),
        py::arg("nibbles") = false);
  m.def("int4_vnni_matmul", &int4_vnni_matmul,
        "bfloat16 [m, k] x 4-bit weights, int8 activations per group of 32 (CPU)", py::arg("x"),
        py::arg("packed"), py::arg("scales_minima"));
  m.def("int4_bf16_available", &int4_bf16_available,
        "whether int4_bf16_matmul was compiled with AVX512-BF16 and VBMI2");
  m.def("int4_bf16_pack", &int4_bf16_pack, "4-bit codes, scales, minima to int4_bf16_matmul's layout",
        py::arg("codes"), py::arg("scales"), py::arg("minima"),
        py::arg("nibbles") = false);
  m.def("int4_bf16_matmul", &int4_bf16_matmul,
        "bfloat16 [m, k] x 4-bit weights, bfloat16 products, float32 sums (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("scales_minima"));
  m.def("int4_avx2_available", &int4_avx2_available,
        "whether int4_avx2_matmul was compiled (AVX2 and FMA, no AVX-512 BF16)");
  m.def("int4_avx2_matmul", &int4_avx2_matmul,
        "bfloat16 [m, k] x int4_bf16_pack's 4-bit weights, int16 activations per group (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("scales_minima"));
  m.def("int4_avx2_grouped", &int4_avx2_grouped,
        "consecutive spans of x's rows (counts), each against its own int4_avx2_matmul "
        "weights of one shape (an MoE layer's experts), in one call",
        py::arg("x"), py::arg("counts"), py::arg("packed"), py::arg("scales_minima"));
  m.def("int4_grouped", &int4_grouped,
        "int4_avx2_grouped on any 4-bit kernel path (avx2, bf16, vnni): a span a call "
        "inside the extension where the path has no grouped kernel of its own",
        py::arg("x"), py::arg("counts"), py::arg("packed"), py::arg("scales_minima"),
        py::arg("path"));
  m.def("routed_int4_experts", &routed_int4_experts,
        "an MoE layer's routed experts (4-bit gate/up and down maps, SiLU-gated) in one call: "
        "each token through its experts, weighted and summed in float32",
        py::arg("x"), py::arg("index"), py::arg("weights"), py::arg("first_packed"),
        py::arg("first_scales_minima"), py::arg("down_packed"), py::arg("down_scales_minima"),
        py::arg("path"), py::arg("intermediate"));
  m.def("int8_rows_limit", &int8_rows_limit,
        "the most rows to give int8_rows_matmul (0: built without its vector path)");
  m.def("int8_rows_matmul", &int8_rows_matmul,
        "bfloat16 [m, k] x int8 [n, k] codes x bfloat16 [n] scales, m <= 4 (CPU)", py::arg("x"),
        py::arg("codes"), py::arg("scales"));
  m.def("bf16_rows_available", &bf16_rows_available,
        "whether bf16_rows_matmul was compiled with AVX512-BF16 or AVX2");
  m.def("bf16_rows_matmul", &bf16_rows_matmul,
        "bfloat16 [m, k] x bfloat16 [n, k] weights (+ bias), m <= 8 (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none());
  m.def("bf16_avx2_available", &bf16_avx2_available,
        "whether bf16_avx2_matmul was compiled (AVX2 and FMA without AVX512-BF16)");
  m.def("bf16_avx2_matmul", &bf16_avx2_matmul,
        "bfloat16 [m, k] x bfloat16 [n, k] weights (+ bias), any m, AVX2 (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none());
  m.def("bf16_fma_available", &bf16_fma_available,
        "whether bf16_fma_matmul was compiled (AVX-512)");
  m.def("bf16_dot_fma_rates", &bf16_dot_fma_rates,
        "GFLOP/s of one thread's vdpbf16ps and vfmadd231ps on 512 bits (0 where not built)");
  m.def("bf16_fma_matmul", &bf16_fma_matmul,
        "bfloat16 [m, k] x bfloat16 [n, k] weights (+ bias) on float32 FMAs, AVX-512 (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("quantize_4bit", &quantize_4bit,
        "weight [n, k] to 4-bit codes packed in nibbles, scales and minima per group (CPU)",
        py::arg("weight"), py::arg("group"));
  m.def("quantize_8bit", &quantize_8bit,
        "weight [n, k] to int8 codes and one scale per output row (CPU)", py::arg("weight"));
  bind_weight_watch(m);
  bind_layer_stack(m);
}
