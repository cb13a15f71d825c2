// Weight-only int8 times bfloat16 rows: a few rows reading the codes near read
// bandwidth, more rows (a batch through the 4-bit modes' int8 LM head) at 2-2.5x torch's.
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
// AVX2-only CPUs (AMD Zen 2 and 3, say) take the same arithmetic 256 bits at a time with
// `vpmaddwd` for `vpdpwssd`: SmolLM2's maps and int8 head at one row 15.3 -> 8.6 ms, at
// 64 rows 237 -> 133 ms against torch's kernel (AMD EPYC, 2 threads).
//
// Rows are read one at a time: four interleaved rows of 2 KB each left the hardware
// prefetcher at half the bandwidth of one stream. With more than 4 activation rows the
// codes are read from L2 instead (rows_matmul), so two output rows go together there.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CBGEN_INT8_AVX512 1
#define CBGEN_INT8_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CBGEN_INT8_AVX512 0
#define CBGEN_INT8_AVX2 1
#else
#define CBGEN_INT8_AVX512 0
#define CBGEN_INT8_AVX2 0
#endif

namespace {

constexpr int64_t kMaxRows = 4;    // activation rows one pass over the codes takes
constexpr int64_t kRowsLimit = 1 << 20;  // int8_rows_limit: no limit but the caller's
constexpr int64_t kGroup = 256;    // activation columns sharing one int16 scale
constexpr int64_t kTask = 64;      // output rows a thread takes at a time

// Where column c of a group sits in its int16 copy. The AVX-512 kernel widens 64 codes
// at a time to int16 within each 128-bit lane: bytes 0-7 of the four lanes make one
// vector, bytes 8-15 the other, so the activations are stored in that order, per 64
// columns. The AVX2 kernel widens 16 codes in order (vpmovsxbw): columns stay in place.
constexpr int64_t stored_at(int64_t c) {
#if CBGEN_INT8_AVX512
  const int64_t chunk = c / 64, lane = (c % 64) / 16, byte = c % 16;
  return chunk * 64 + (byte / 8) * 32 + lane * 8 + byte % 8;
#else
  return c;
#endif
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
// One output row at a time (N = 1: a call's codes read once from memory) prefetches them
// this far ahead, as the bfloat16 row kernel does: with the hardware prefetcher alone the
// 1B shape's int8 maps and head read 17 GB/s at one row on the 2026-12-07 Intel Xeon (2
// threads).
constexpr int64_t kPrefetchBytes = 4096;

inline __mmask64 chunk_mask(int64_t left) {
  return left >= 64 ? ~__mmask64(0) : left <= 0 ? 0 : (__mmask64(1) << left) - 1;
}

// N rows of codes (row stride k) against M activation rows, into out[r * M + j] (not yet
// scaled by the rows' weight scales). Per group of 256 columns the int16 products add
// up exactly in int32 (at most 256 * 127 * 32767 per lane), then once into float32.
// C sums per pair of rows (bytes 0-7 and 8-15 of each 128-bit lane into their own with
// C = 2), so that consecutive `vpdpwssd`s do not wait on each other: one output row
// needs two, two output rows make chains enough with one and keep every sum in a
// register.
template <int N, int M, int C>
inline void dot_rows(const int8_t* w, int64_t k, int64_t groups, const int16_t* xq,
                     const float* dx, float* out) {
  __m512 total[N][M];
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < M; ++j) total[r][j] = _mm512_setzero_ps();
  const int64_t stride = groups * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[C][N][M];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < N; ++r)
        for (int j = 0; j < M; ++j) dot[c][r][j] = _mm512_setzero_si512();
    const int64_t begin = g * kGroup, end = std::min(k, begin + kGroup);
    for (int64_t i = begin; i < end; i += 64) {
      // The last chunk of a row may be short: its missing codes load as zeros.
      const __mmask64 mask = chunk_mask(end - i);
      __m512i lo[N], hi[N];
      // A prefetch never faults, so one past the last row is harmless.
      if (N == 1) _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes, _MM_HINT_T0);
      for (int r = 0; r < N; ++r) {
        const __m512i v = _mm512_maskz_loadu_epi8(mask, w + r * k + i);
        // Bytes 0-7 (lo) and 8-15 (hi) of each 128-bit lane, sign-extended to int16 in
        // place; the activations are stored in that order (stored_at).
        lo[r] = _mm512_srai_epi16(_mm512_unpacklo_epi8(v, v), 8);
        hi[r] = _mm512_srai_epi16(_mm512_unpackhi_epi8(v, v), 8);
      }
      for (int j = 0; j < M; ++j) {
        const int16_t* xj = xq + j * stride + i;
        const __m512i x_lo = _mm512_loadu_si512(xj), x_hi = _mm512_loadu_si512(xj + 32);
        for (int r = 0; r < N; ++r) {
          dot[0][r][j] = _mm512_dpwssd_epi32(dot[0][r][j], lo[r], x_lo);
          dot[C - 1][r][j] = _mm512_dpwssd_epi32(dot[C - 1][r][j], hi[r], x_hi);
        }
      }
    }
    for (int r = 0; r < N; ++r) {
      for (int j = 0; j < M; ++j) {
        __m512i sum = dot[0][r][j];
        if (C == 2) sum = _mm512_add_epi32(sum, dot[C - 1][r][j]);
        total[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx[j * groups + g]),
                                      total[r][j]);
      }
    }
  }
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < M; ++j) out[r * M + j] = _mm512_reduce_add_ps(total[r][j]);
}
#elif CBGEN_INT8_AVX2
// The AVX-512 kernel's arithmetic in 256-bit registers, with no VNNI: 32 codes widened to
// int16 in order (vpmovsxbw straight from memory, two 16-byte halves), and `vpmaddwd`
// multiplies 16 of them by 16 int16 activations and adds pairs into exact int32 sums (at
// most 32 products of 127 * 32767 a lane per group); a group's sums become float32 once.
//
// One output row at a time (N = 1: a call's codes read once from memory) also prefetches
// them kPrefetchBytes ahead. Both took SmolLM2's int8 LM head at one row from 18-21 to
// 21-26 GB/s and the 1B shape's from 15-21 to 19-23 on a Zen 3 EPYC (2 threads; a plain
// read of the same bytes made 29-36 and 21-26): widening a 32-byte load took an extract
// for its high half, and without the prefetch each row's first lines waited.
constexpr int64_t kPrefetchBytes = 1024;

template <int N, int M, int C>
inline void dot_rows(const int8_t* w, int64_t k, int64_t groups, const int16_t* xq,
                     const float* dx, float* out) {
  __m256 total[N][M];
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < M; ++j) total[r][j] = _mm256_setzero_ps();
  const int64_t stride = groups * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[C][N][M];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < N; ++r)
        for (int j = 0; j < M; ++j) dot[c][r][j] = _mm256_setzero_si256();
    const int64_t begin = g * kGroup, end = std::min(k, begin + kGroup);
    for (int64_t i = begin; i < end; i += 32) {
      __m256i lo[N], hi[N];
      for (int r = 0; r < N; ++r) {
        const int8_t* codes = w + r * k + i;
        // A prefetch never faults, so one past the last row is harmless.
        if (N == 1) _mm_prefetch(reinterpret_cast<const char*>(codes) + kPrefetchBytes, _MM_HINT_T0);
        alignas(16) int8_t tail[32];
        if (end - i < 32) {  // a short last chunk: its missing codes are zeros, nothing read past the row
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, codes, end - i);
          codes = tail;
        }
        lo[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
        hi[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
      }
      for (int j = 0; j < M; ++j) {
        const int16_t* xj = xq + j * stride + i;
        const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj));
        const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + 16));
        for (int r = 0; r < N; ++r) {
          dot[0][r][j] = _mm256_add_epi32(dot[0][r][j], _mm256_madd_epi16(lo[r], x_lo));
          dot[C - 1][r][j] = _mm256_add_epi32(dot[C - 1][r][j], _mm256_madd_epi16(hi[r], x_hi));
        }
      }
    }
    for (int r = 0; r < N; ++r) {
      for (int j = 0; j < M; ++j) {
        __m256i sum = dot[0][r][j];
        if (C == 2) sum = _mm256_add_epi32(sum, dot[C - 1][r][j]);
        total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                      _mm256_set1_ps(dx[j * groups + g]), total[r][j]);
      }
    }
  }
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < M; ++j) out[r * M + j] = hsum256(total[r][j]);
}
#else
template <int N, int M, int C>
inline void dot_rows(const int8_t* w, int64_t k, int64_t groups, const int16_t* xq,
                     const float* dx, float* out) {
  const int64_t stride = groups * kGroup;
  for (int r = 0; r < N; ++r) {
    for (int j = 0; j < M; ++j) {
      float sum = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t i = g * kGroup; i < std::min(k, (g + 1) * kGroup); ++i)
          dot += static_cast<int32_t>(w[r * k + i]) *
                 xq[j * stride + g * kGroup + stored_at(i - g * kGroup)];
        sum += static_cast<float>(dot) * dx[j * groups + g];
      }
      out[r * M + j] = sum;
    }
  }
}
#endif

// Output rows [row, row + N) against activation rows [first, first + M).
template <int N, int M>
void rows_tile(const int8_t* w, const at::BFloat16* scales, int64_t n, int64_t k, int64_t groups,
               const int16_t* xq, const float* dx, int64_t row, int64_t first, at::BFloat16* y) {
  float sums[N * M];
  dot_rows<N, M, N == 1 ? 2 : 1>(w + row * k, k, groups, xq + first * groups * kGroup,
                                 dx + first * groups, sums);
  for (int r = 0; r < N; ++r) {
    const float scale = static_cast<float>(scales[row + r]);
    for (int j = 0; j < M; ++j) {
      y[(first + j) * n + row + r] = static_cast<at::BFloat16>(sums[r * M + j] * scale);
    }
  }
}

template <int N>
void rows_tile_dispatch(int64_t rows, const int8_t* w, const at::BFloat16* scales, int64_t n,
                        int64_t k, int64_t groups, const int16_t* xq, const float* dx, int64_t row,
                        int64_t first, at::BFloat16* y) {
  switch (rows) {
    case 1: rows_tile<N, 1>(w, scales, n, k, groups, xq, dx, row, first, y); break;
    case 2: rows_tile<N, 2>(w, scales, n, k, groups, xq, dx, row, first, y); break;
    case 3: rows_tile<N, 3>(w, scales, n, k, groups, xq, dx, row, first, y); break;
    default: rows_tile<N, 4>(w, scales, n, k, groups, xq, dx, row, first, y); break;
  }
}

// Up to 4 activation rows: each output row alone, its codes read once from memory. More:
// each thread's task of 64 output rows (128 KB of codes at k = 2,048, kept in L2) meets
// every 4 activation rows in turn, two output rows at a time, so the codes come from
// memory once a call and the activations (16 KB for 4 rows) stay in L1.
void rows_matmul(const int8_t* w, const at::BFloat16* scales, int64_t n, int64_t k,
                 int64_t groups, int64_t m, const int16_t* xq, const float* dx, at::BFloat16* y) {
  const int64_t pair = m <= kMaxRows ? 1 : 2;
  at::parallel_for(0, (n + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(n, end * kTask);
    for (int64_t task = begin * kTask; task < last; task += kTask) {
      const int64_t task_end = std::min(last, task + kTask);
      for (int64_t first = 0; first < m; first += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - first);
        for (int64_t row = task; row < task_end; row += pair) {
          if (pair == 2 && row + 1 < task_end) {
            rows_tile_dispatch<2>(rows, w, scales, n, k, groups, xq, dx, row, first, y);
          } else {
            for (int64_t r = row; r < std::min(task_end, row + pair); ++r)
              rows_tile_dispatch<1>(rows, w, scales, n, k, groups, xq, dx, r, first, y);
          }
        }
      }
    }
  });
}

}  // namespace

// The most rows int8_rows_matmul should be given at once (it takes any number; 0 where
// it was built with neither AVX512-VNNI nor AVX2: its scalar path is there for
// correctness, and torch's kernel is faster than it).
int64_t int8_rows_limit() { return CBGEN_INT8_AVX512 || CBGEN_INT8_AVX2 ? kRowsLimit : 0; }

// x: bfloat16 [m, k]; codes: int8 [n, k]; scales: bfloat16 [n].
// Returns bfloat16 [m, n], what torch._weight_int8pack_mm(x, codes, scales) returns.
at::Tensor int8_rows_matmul(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [m, k]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes: contiguous int8 [n, k]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k, "int8_rows_matmul: x has ", k, " columns, codes ",
              codes.size(1));
  TORCH_CHECK(m >= 1, "int8_rows_matmul takes at least one row");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == n,
              "scales: contiguous bfloat16 [n]");
  auto xc = x.contiguous();
  const int64_t groups = (k + kGroup - 1) / kGroup;
  std::vector<int16_t> xq(m * groups * kGroup);
  std::vector<float> dx(m * groups);
  quantize_rows(xc.data_ptr<at::BFloat16>(), m, k, groups, xq.data(), dx.data());
  auto out = at::empty({m, n}, x.options());
  rows_matmul(codes.data_ptr<int8_t>(), scales.data_ptr<at::BFloat16>(), n, k, groups, m,
              xq.data(), dx.data(), out.data_ptr<at::BFloat16>());
  return out;
}
