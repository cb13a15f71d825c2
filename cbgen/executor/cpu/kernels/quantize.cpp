// Weight quantization at load time: the int8 and 4-bit formulas of
// cbgen/executor/cpu/quantization.py, in one pass over each row.
//
// torch's path makes a float32 copy of each chunk of rows and walks it five times
// (min and max, subtract, divide, round, clamp) before the codes are packed into
// nibbles by two more strided passes: about 4 s of a Llama-3.2-1B-shaped model's
// 12 s load in "int4" on 2 cores. Here each group is read once into a small buffer and
// its codes are written packed. The arithmetic is torch's, operation by operation in
// float32 (no FMA contraction: the build passes -ffp-contract=off), so codes, scales
// and minima are the same bits; the tests compare both paths.
//
//   int4:  low = min(group), scale = max((max(group) - low) / 15, 1e-10),
//          code = clamp(round_half_even((w - low) / scale), 0, 15)
//   int8:  scale = max(max|row| / 127, 1e-10), code = clamp(round_half_even(w / scale), -127, 127)
//
// A weight that is not finite has no code: torch's path turned it into an undefined
// cast; here it is refused (ValueError, naming the row).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 16;

// bad holds the first row with a value that is not finite, or -1.
void note_bad(std::atomic<int64_t>& bad, int64_t row) {
  int64_t seen = bad.load();
  while ((seen < 0 || row < seen) && !bad.compare_exchange_weak(seen, row)) {
  }
}

template <typename T>
void quantize_4bit_rows(const T* w, int64_t n, int64_t k, int64_t group, uint8_t* packed,
                        float* scales, float* minima, std::atomic<int64_t>& bad) {
  const int64_t groups = k / group;
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> values(group);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = w + r * k + g * group;
        float low = INFINITY, high = -INFINITY;
        bool finite = true;
        for (int64_t i = 0; i < group; ++i) {
          const float v = static_cast<float>(src[i]);
          finite = finite && std::isfinite(v);
          values[i] = v;
          low = std::min(low, v);
          high = std::max(high, v);
        }
        if (!finite) {
          note_bad(bad, r);
          break;
        }
        const float scale = std::max((high - low) / 15.0f, 1e-10f);
        scales[r * groups + g] = scale;
        minima[r * groups + g] = low;
        auto code = [&](float v) {
          const float c = std::nearbyint((v - low) / scale);
          return static_cast<uint8_t>(std::min(std::max(c, 0.0f), 15.0f));
        };
        uint8_t* out = packed + (r * k + g * group) / 2;
        for (int64_t i = 0; i < group; i += 2) {
          out[i / 2] = static_cast<uint8_t>(code(values[i]) | (code(values[i + 1]) << 4));
        }
      }
    }
  });
}

template <typename T>
void quantize_8bit_rows(const T* w, int64_t n, int64_t k, int8_t* codes, float* scales,
                        std::atomic<int64_t>& bad) {
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = w + r * k;
      float largest = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < k; ++i) {
        const float v = static_cast<float>(src[i]);
        finite = finite && std::isfinite(v);
        largest = std::max(largest, std::fabs(v));
      }
      if (!finite) {
        note_bad(bad, r);
        continue;
      }
      const float scale = std::max(largest / 127.0f, 1e-10f);
      scales[r] = scale;
      int8_t* out = codes + r * k;
      for (int64_t i = 0; i < k; ++i) {
        const float c = std::nearbyint(static_cast<float>(src[i]) / scale);
        out[i] = static_cast<int8_t>(std::min(std::max(c, -127.0f), 127.0f));
      }
    }
  });
}

void check_weight(const at::Tensor& weight, const char* name) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.device().is_cpu(), name,
                    ": a 2-D CPU weight [out, in]");
  const auto type = weight.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, name,
                    ": float32, bfloat16 or float16 weights, got ", type);
}

void refuse_bad(const std::atomic<int64_t>& bad, const char* name) {
  const int64_t row = bad.load();
  TORCH_CHECK_VALUE(row < 0, name, ": row ", row,
                    " of the weight holds a value that is not finite (NaN or infinity)");
}

}  // namespace

// weight: [n, k] float32, bfloat16 or float16, k a multiple of group (even). Returns
// (codes uint8 [n, k / 2], column 2j in the low nibble of byte j and 2j + 1 in the
// high one; scales float32 [n, k / group]; minima float32 [n, k / group]).
std::vector<at::Tensor> quantize_4bit(const at::Tensor& weight, int64_t group) {
  check_weight(weight, "quantize_4bit");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK_VALUE(group > 0 && group % 2 == 0 && k % group == 0, "quantize_4bit: ", k,
                    " input columns are not a multiple of ", group);
  const auto w = weight.contiguous();
  const auto floats = weight.options().dtype(at::kFloat);
  auto packed = at::empty({n, k / 2}, weight.options().dtype(at::kByte));
  auto scales = at::empty({n, k / group}, floats);
  auto minima = at::empty({n, k / group}, floats);
  std::atomic<int64_t> bad{-1};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "quantize_4bit", [&] {
    quantize_4bit_rows(w.data_ptr<scalar_t>(), n, k, group, packed.data_ptr<uint8_t>(),
                       scales.data_ptr<float>(), minima.data_ptr<float>(), bad);
  });
  refuse_bad(bad, "quantize_4bit");
  return {packed, scales, minima};
}

// weight: [n, k] float32, bfloat16 or float16. Returns (codes int8 [n, k], scales
// float32 [n]).
std::vector<at::Tensor> quantize_8bit(const at::Tensor& weight) {
  check_weight(weight, "quantize_8bit");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto w = weight.contiguous();
  auto codes = at::empty({n, k}, weight.options().dtype(at::kChar));
  auto scales = at::empty({n}, weight.options().dtype(at::kFloat));
  std::atomic<int64_t> bad{-1};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "quantize_8bit", [&] {
    quantize_8bit_rows(w.data_ptr<scalar_t>(), n, k, codes.data_ptr<int8_t>(),
                       scales.data_ptr<float>(), bad);
  });
  refuse_bad(bad, "quantize_8bit");
  return {codes, scales};
}
