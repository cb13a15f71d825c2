// Row-wise argmax of float32 logits, the greedy sampler's whole job.
//
// torch.argmax over a [64, 49152] float32 tensor took 2.7 ms on 2 cores (it
// walks each row element by element), about 2% of a 64-row decode step, while
// torch.amax over the same tensor takes 0.1 ms. This is two vector passes per
// row instead: the maximum (noting any NaN), then the first position holding it.
// The answer is torch.argmax's, ties included: the first maximal element, and
// the first NaN when a row has one (torch ranks NaN above every number).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "simd.h"

namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
  }
  return -1;
}

int64_t argmax_row(const float* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(row + i);
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, x);
  }
  nan = unordered != 0;
  best = _mm512_reduce_max_ps(m);
#elif CBGEN_VFLOAT  // AVX2 with FMA: simd.h's 8-lane vfloat
  __m256 m = _mm256_set1_ps(best);
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, x);
  }
  nan = _mm256_movemask_ps(unordered) != 0;
  best = vhmax(m);
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(row[i]);
    if (row[i] > best) best = row[i];
  }
  if (nan) return first_nan(row, n);
  i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif CBGEN_VFLOAT  // AVX2 with FMA: simd.h's 8-lane vfloat
  const __m256 target = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    if (row[i] == best) return i;
  }
  return 0;  // only reached for n == 0, which the caller rejects
}

}  // namespace

// logits [rows, vocab] float32 -> [rows] int64.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax_rows takes [rows, vocab] logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "argmax_rows takes float32 logits");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows needs a non-empty vocabulary");
  TORCH_CHECK(logits.device().is_cpu(), "argmax_rows runs on CPU tensors");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * vocab, vocab);
  });
  return out;
}
