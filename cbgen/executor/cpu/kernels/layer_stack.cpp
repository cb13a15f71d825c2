// Every layer of a plain decoder in one call from Python: the fast decoder's loop
// (cbgen.executor.cpu.fast_forward) moved into C++ for the steps whose maps all run cbgen's
// own kernels (bfloat16 through the row kernel, 4-bit, int8 rows): one stream's decodes and
// short chunks, and any step in 4 bits.
//
// The loop calls the very kernels the Python loop calls, in the same order and with the
// same arguments, so every bit of its output is the Python loop's. What it saves is the
// loop itself: on one SmolLM2 stream in bfloat16 (2 threads, the 2026-12-07 Intel Xeon)
// 1.3 ms of a 14.6 ms forward went to the Python between the kernels (attribute lookups,
// views, the maps' routing, argument conversion), slow there because each step's 270 MB
// of weights had pushed the interpreter's objects out of the caches.
//
// A plain layer: RMSNorm, fused q/k/v, rotary embedding and K/V store (rope_qkv), paged
// attention (windows and soft-capping included), o, RMSNorm, fused gate/up,
// silu(gate) * up, down; each map with its bias where it has one, added as its Python map
// adds it; the residual stream float32. Python (cbgen.executor.cpu.layer_stack) decides
// which models and steps qualify.
#include <torch/extension.h>

#include <vector>

#include "entry_points.h"

namespace {

// One linear map as its Python map (cbgen.executor.cpu.prepack.PackedMap, quantization's
// Int4Map and Int8Map) runs it on the fast decoder's contiguous bfloat16 rows.
class StackMap {
 public:
  StackMap(const std::string& kind, const at::Tensor& first,
           const c10::optional<at::Tensor>& second, const c10::optional<at::Tensor>& bias,
           int64_t out_features)
      : first_(first), second_(second.value_or(at::Tensor())), bias_(bias),
        out_features_(out_features) {
    if (kind == "bf16_rows") {
      kind_ = Kind::kBf16Rows;
      TORCH_CHECK(first.scalar_type() == at::kBFloat16 && first.dim() == 2 &&
                      first.is_contiguous() && first.size(0) == out_features,
                  "StackMap: a bf16_rows weight must be contiguous bfloat16 [out, in]");
    } else if (kind == "int4_bf16") {
      kind_ = Kind::kInt4Bf16;
    } else if (kind == "int4_vnni") {
      kind_ = Kind::kInt4Vnni;
    } else if (kind == "int4_avx2") {
      kind_ = Kind::kInt4Avx2;
    } else if (kind == "int8_rows") {
      kind_ = Kind::kInt8Rows;
    } else {
      TORCH_CHECK(false, "StackMap: no kernel kind '", kind,
                  "' (bf16_rows, int4_bf16, int4_vnni, int4_avx2, int8_rows)");
    }
    TORCH_CHECK(kind_ == Kind::kBf16Rows || second_.defined(), "StackMap: ", kind,
                " needs its scales");
    TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == out_features),
                "StackMap: the bias must be a vector of out_features");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor out;
    switch (kind_) {
      case Kind::kBf16Rows:
        return bf16_rows_matmul(x, first_, bias_);  // the kernel adds the bias itself
      case Kind::kInt4Bf16: out = int4_bf16_matmul(x, first_, second_); break;
      case Kind::kInt4Vnni: out = int4_vnni_matmul(x, first_, second_); break;
      case Kind::kInt4Avx2: out = int4_avx2_matmul(x, first_, second_); break;
      case Kind::kInt8Rows: out = int8_rows_matmul(x, first_, second_); break;
    }
    if (bias_.has_value()) out.add_(*bias_);  // as the quantized maps add theirs, in bfloat16
    return out;
  }

  int64_t out_features() const { return out_features_; }

 private:
  enum class Kind { kBf16Rows, kInt4Bf16, kInt4Vnni, kInt4Avx2, kInt8Rows };
  Kind kind_ = Kind::kBf16Rows;
  at::Tensor first_, second_;
  c10::optional<at::Tensor> bias_;
  int64_t out_features_;
};

struct StackLayer {
  int64_t cache_layer;  // the layer's index in the cache (and in layer_group)
  at::Tensor input_norm;
  double input_eps;
  StackMap qkv, o;
  at::Tensor post_norm;
  double post_eps;
  StackMap gate_up, down;
  int64_t intermediate;
  double scale;
  int64_t sliding_window;  // 0: none
  double softcap;          // 0: none
};

class LayerStack {
 public:
  LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0,
                "LayerStack: heads must be a positive multiple of kv_heads");
  }

  void add_layer(int64_t cache_layer, const at::Tensor& input_norm, double input_eps,
                 const StackMap& qkv, const StackMap& o, const at::Tensor& post_norm,
                 double post_eps, const StackMap& gate_up, const StackMap& down,
                 int64_t intermediate, double scale, int64_t sliding_window, double softcap) {
    const int64_t hidden = input_norm.numel();
    TORCH_CHECK(qkv.out_features() == (heads_ + 2 * kv_heads_) * head_dim_,
                "LayerStack: qkv's outputs are not (heads + 2 kv_heads) * head_dim");
    TORCH_CHECK(o.out_features() == hidden && down.out_features() == hidden &&
                    post_norm.numel() == hidden,
                "LayerStack: o, down and the norms must be of the hidden size");
    TORCH_CHECK(intermediate > 0 && gate_up.out_features() == 2 * intermediate,
                "LayerStack: gate_up must have 2 * intermediate outputs");
    TORCH_CHECK(cache_layer >= 0, "LayerStack: cache_layer must be a layer index");
    TORCH_CHECK(layers_.empty() || hidden == layers_.front().input_norm.numel(),
                "LayerStack: layers differ in width");
    layers_.push_back({cache_layer, input_norm, input_eps, qkv, o, post_norm, post_eps, gate_up,
                       down, intermediate, scale, sliding_window, softcap});
  }

  // Runs every layer on `hidden` (float32 [tokens, hidden], the residual stream before the
  // first layer, updated in place) and returns the last layer's output (bfloat16 [tokens,
  // hidden]), which the caller adds in the final norm. keys/values: the cache's tensors by
  // cache layer; slots/tables/lens: each cache group's slot mapping, block tables and
  // context lengths (one row per token); layer_group: each cache layer's group.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const std::vector<at::Tensor>& slots, const std::vector<at::Tensor>& tables,
                     const std::vector<at::Tensor>& lens,
                     const std::vector<int64_t>& layer_group) const {
    TORCH_CHECK(!layers_.empty(), "LayerStack: no layers");
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2,
                "LayerStack: hidden must be float32 [tokens, hidden]");
    TORCH_CHECK(keys.size() == values.size() && slots.size() == tables.size() &&
                    tables.size() == lens.size(),
                "LayerStack: keys/values and slots/tables/lens must pair up");
    const int64_t tokens = hidden.size(0);
    const c10::optional<at::ScalarType> bf16(at::kBFloat16);
    c10::optional<at::Tensor> delta;
    for (const StackLayer& layer : layers_) {
      const size_t c = static_cast<size_t>(layer.cache_layer);
      TORCH_CHECK(c < keys.size() && c < layer_group.size(), "LayerStack: layer ", c,
                  " is outside the cache");
      const int64_t g = layer_group[c];
      TORCH_CHECK(g >= 0 && static_cast<size_t>(g) < slots.size(), "LayerStack: layer ", c,
                  "'s group ", g, " has no tables");
      at::Tensor x = add_rms_norm(hidden, delta, layer.input_norm, layer.input_eps, bf16);
      const at::Tensor qkv = layer.qkv(x);
      const at::Tensor q = rope_qkv(qkv, cos, sin, heads_, kv_heads_, keys[c], values[c],
                                    slots[g], head_dim_);
      const at::Tensor out =
          paged_decode_attention(q, keys[c], values[c], tables[g], lens[g], layer.scale,
                                 layer.sliding_window, layer.softcap, c10::nullopt);
      // bfloat16 for o, as the loop's .to(dtype) rounds it (a float32 K/V cache makes
      // attention's rows float32; a bfloat16 one returns them as they are).
      delta = layer.o(out.view({tokens, -1}).to(at::kBFloat16));
      x = add_rms_norm(hidden, delta, layer.post_norm, layer.post_eps, bf16);
      const at::Tensor gate_up = layer.gate_up(x);
      const at::Tensor act = silu_mul(gate_up, layer.intermediate);
      delta = layer.down(act);
    }
    return *delta;
  }

  size_t size() const { return layers_.size(); }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  std::vector<StackLayer> layers_;
};

}  // namespace

void bind_layer_stack(py::module_& m) {
  py::class_<StackMap>(m, "StackMap", "a linear map as LayerStack calls it")
      .def(py::init<const std::string&, const at::Tensor&, const c10::optional<at::Tensor>&,
                    const c10::optional<at::Tensor>&, int64_t>(),
           py::arg("kind"), py::arg("first"), py::arg("second"), py::arg("bias"),
           py::arg("out_features"))
      .def_property_readonly("out_features", &StackMap::out_features);
  py::class_<LayerStack>(m, "LayerStack",
                         "every layer of a plain decoder in one call")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"))
      .def("add_layer", &LayerStack::add_layer, py::arg("cache_layer"), py::arg("input_norm"),
           py::arg("input_eps"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("gate_up"), py::arg("down"), py::arg("intermediate"),
           py::arg("scale"), py::arg("sliding_window"), py::arg("softcap"))
      .def("forward", &LayerStack::forward, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("tables"),
           py::arg("lens"), py::arg("layer_group"),
           // Tensors only from here on: other Python threads (the server's event loop,
           // the engine's scheduling beside an async step) run while the layers do.
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &LayerStack::size);
}
