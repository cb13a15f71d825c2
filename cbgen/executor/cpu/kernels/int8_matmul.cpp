// Weight-only int8 times a few bfloat16 rows, reading the codes near read bandwidth.
//
// torch's `_weight_int8pack_mm` reads int8 weights at ~17 GB/s on 2 cores at one row
// (this machine streams ~35-50): a 1B model's 128,256 x 2,048 int8 LM head took 15 ms
// of a 4-bit single stream's ~30 ms a token. Decoding a few sequences is a
// matrix-vector product per row, so each output here is one dot product along a
// contiguous row of codes, in torch's own row-major [n, k] layout (the map keeps one
// copy for both kernels).
//
// Widening every code to float32 for an FMA kept one thread at ~10 GB/s. Instead each
// activation row is rounded to int16 per group of 256 columns (a step of the group's
// largest magnitude over 32767, about 2^-15 of it, where bfloat16 itself rounds each
// value to 2^-9 of its own magnitude), and `vpdpwssd` multiplies 32 codes by 32 int16
// activations and adds pairs into exact int32 sums; a group's sum becomes float32 once:
//
//   y[m, n] = scale[n] * sum_g step[m, g] * sum_k code[n, k] * xq[m, k].
//
// Rows are read one at a time: four interleaved rows of 2 KB each left the hardware
// prefetcher at half the bandwidth of one stream.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CBGEN_INT8_AVX512 1
#else
#define CBGEN_INT8_AVX512 0
#endif

namespace {

constexpr int64_t kMaxRows = 4;    // activation rows one call takes
constexpr int64_t kGroup = 256;    // activation columns sharing one int16 scale
constexpr int64_t kTask = 64;      // output rows a thread takes at a time

// Where column c of a group sits in its int16 copy. The kernel widens 64 codes at a time
// to int16 within each 128-bit lane: bytes 0-7 of the four lanes make one vector, bytes
// 8-15 the other, so the activations are stored in that order, per 64 columns.
constexpr int64_t stored_at(int64_t c) {
  const int64_t chunk = c / 64, lane = (c % 64) / 16, byte = c % 16;
  return chunk * 64 + (byte / 8) * 32 + lane * 8 + byte % 8;
}

// Each row's activations as int16 per group of 256 columns (zero-padded to whole
// groups), and each group's scale: its largest magnitude over 32767.
void quantize_rows(const at::BFloat16* x, int64_t m, int64_t k, int64_t groups, int16_t* xq,
                   float* dx) {
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * kGroup, end = std::min(k, begin + kGroup);
      float amax = 0.f;
      for (int64_t i = begin; i < end; ++i)
        amax = std::max(amax, std::fabs(static_cast<float>(x[j * k + i])));
      // A group of zeros (or of denormals, whose inverse scale would overflow) gets
      // no codes.
      const float scale = amax / 32767.f;
      const float inv = scale >= FLT_MIN ? 1.f / scale : 0.f;
      int16_t* out = xq + j * groups * kGroup + begin;
      for (int64_t i = begin; i < begin + kGroup; ++i) {
        const float value = i < end ? static_cast<float>(x[j * k + i]) : 0.f;
        out[stored_at(i - begin)] = static_cast<int16_t>(std::nearbyint(value * inv));
      }
      dx[j * groups + g] = scale;
    }
  }
}

#if CBGEN_INT8_AVX512
inline __mmask64 chunk_mask(int64_t left) {
  return left >= 64 ? ~__mmask64(0) : left <= 0 ? 0 : (__mmask64(1) << left) - 1;
}

// One row of codes against M activation rows, into out[0..M) (not yet scaled by the
// row's weight scale). Per group of 256 columns the int16 products add up exactly in
// int32 (at most 256 * 127 * 32767 per lane), then once into float32.
template <int M>
inline void dot_row(const int8_t* w, int64_t k, int64_t groups, const int16_t* xq,
                    const float* dx, float* out) {
  __m512 total[M];
  for (int j = 0; j < M; ++j) total[j] = _mm512_setzero_ps();
  const int64_t stride = groups * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    // Two sums per activation row (bytes 0-7 and 8-15 of each 128-bit lane), so
    // consecutive `vpdpwssd`s do not wait on each other.
    __m512i dot[2][M];
    for (int u = 0; u < 2; ++u)
      for (int j = 0; j < M; ++j) dot[u][j] = _mm512_setzero_si512();
    const int64_t begin = g * kGroup, end = std::min(k, begin + kGroup);
    for (int64_t i = begin; i < end; i += 64) {
      // The last chunk of a row may be short: its missing codes load as zeros.
      const __m512i v = _mm512_maskz_loadu_epi8(chunk_mask(end - i), w + i);
      // Bytes 0-7 (lo) and 8-15 (hi) of each 128-bit lane, sign-extended to int16 in
      // place; the activations are stored in that order (stored_at).
      const __m512i lo = _mm512_srai_epi16(_mm512_unpacklo_epi8(v, v), 8);
      const __m512i hi = _mm512_srai_epi16(_mm512_unpackhi_epi8(v, v), 8);
      for (int j = 0; j < M; ++j) {
        const int16_t* xj = xq + j * stride + i;
        dot[0][j] = _mm512_dpwssd_epi32(dot[0][j], lo, _mm512_loadu_si512(xj));
        dot[1][j] = _mm512_dpwssd_epi32(dot[1][j], hi, _mm512_loadu_si512(xj + 32));
      }
    }
    for (int j = 0; j < M; ++j) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[0][j], dot[1][j]));
      total[j] = _mm512_fmadd_ps(sum, _mm512_set1_ps(dx[j * groups + g]), total[j]);
    }
  }
  for (int j = 0; j < M; ++j) out[j] = _mm512_reduce_add_ps(total[j]);
}
#else
template <int M>
inline void dot_row(const int8_t* w, int64_t k, int64_t groups, const int16_t* xq,
                    const float* dx, float* out) {
  const int64_t stride = groups * kGroup;
  for (int j = 0; j < M; ++j) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t i = g * kGroup; i < std::min(k, (g + 1) * kGroup); ++i)
        dot += static_cast<int32_t>(w[i]) * xq[j * stride + g * kGroup + stored_at(i - g * kGroup)];
      sum += static_cast<float>(dot) * dx[j * groups + g];
    }
    out[j] = sum;
  }
}
#endif

template <int M>
void rows_matmul(const int8_t* w, const at::BFloat16* scales, int64_t n, int64_t k,
                 int64_t groups, const int16_t* xq, const float* dx, at::BFloat16* y) {
  at::parallel_for(0, (n + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    float sums[M];
    for (int64_t row = begin * kTask; row < std::min(n, end * kTask); ++row) {
      dot_row<M>(w + row * k, k, groups, xq, dx, sums);
      const float scale = static_cast<float>(scales[row]);
      for (int j = 0; j < M; ++j) y[j * n + row] = static_cast<at::BFloat16>(sums[j] * scale);
    }
  });
}

}  // namespace

// The most rows int8_rows_matmul should be given; 0 where it was built without AVX512-VNNI
// (its scalar path is there for correctness, and torch's kernel is faster than it).
int64_t int8_rows_limit() { return CBGEN_INT8_AVX512 ? kMaxRows : 0; }

// x: bfloat16 [m, k] with m <= 4; codes: int8 [n, k]; scales: bfloat16 [n].
// Returns bfloat16 [m, n], what torch._weight_int8pack_mm(x, codes, scales) returns.
at::Tensor int8_rows_matmul(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [m, k]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes: contiguous int8 [n, k]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k, "int8_rows_matmul: x has ", k, " columns, codes ",
              codes.size(1));
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "int8_rows_matmul takes 1 to ", kMaxRows, " rows, not ", m);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == n,
              "scales: contiguous bfloat16 [n]");
  auto xc = x.contiguous();
  const int64_t groups = (k + kGroup - 1) / kGroup;
  std::vector<int16_t> xq(m * groups * kGroup);
  std::vector<float> dx(m * groups);
  quantize_rows(xc.data_ptr<at::BFloat16>(), m, k, groups, xq.data(), dx.data());
  auto out = at::empty({m, n}, x.options());
  const int8_t* w = codes.data_ptr<int8_t>();
  const at::BFloat16* s = scales.data_ptr<at::BFloat16>();
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  switch (m) {
    case 1: rows_matmul<1>(w, s, n, k, groups, xq.data(), dx.data(), y); break;
    case 2: rows_matmul<2>(w, s, n, k, groups, xq.data(), dx.data(), y); break;
    case 3: rows_matmul<3>(w, s, n, k, groups, xq.data(), dx.data(), y); break;
    default: rows_matmul<4>(w, s, n, k, groups, xq.data(), dx.data(), y); break;
  }
  return out;
}
