// bfloat16 weights times a few bfloat16 rows with AVX512-BF16, streaming the weights.
//
// At one to four rows a linear map is a matrix-vector product per row, bound by reading
// the weights once. oneDNN's packed bf16 kernels read them at ~20-25 GB/s on 2 cores at
// one row, below what this machine streams. Each output here is a dot product along
// one contiguous weight row, read one row at a time (interleaving four rows left the
// hardware prefetcher at half speed): `vdpbf16ps` multiplies 32 bfloat16 weights by 32
// bfloat16 activations and adds the pairs into 16 float32 sums. Products of two
// bfloat16 are exact in float32, so the result differs from oneDNN's only by the order
// of the float32 sums (and `vdpbf16ps` flushes denormal inputs to zero, as oneDNN's
// bf16 kernels do).
//
// CPUs without AVX512-BF16 but with AVX2 and FMA widen each weight to float32 (an
// unpack under zeros) and use float32 FMAs: where oneDNN cannot pack bfloat16 at all
// (AVX2-only CPUs) this is what serves 1 to 8 rows, at about twice torch's bfloat16
// F.linear there (SmolLM2's maps at one row: 26.4 -> 13.3 ms on an AMD EPYC, 2 threads)
// and twice bf16_avx2_matmul's speed at 5 to 8 rows (below).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <cstdint>
#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CBGEN_BF16_DOT 1
#define CBGEN_BF16_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CBGEN_BF16_DOT 0
#define CBGEN_BF16_AVX2 1
#else
#define CBGEN_BF16_DOT 0
#define CBGEN_BF16_AVX2 0
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // activation rows one call takes
constexpr int64_t kTask = 64;    // weight rows a thread takes at a time

#if CBGEN_BF16_DOT
inline __mmask32 head_mask(int64_t left) {
  return left >= 32 ? ~__mmask32(0) : left <= 0 ? 0 : static_cast<__mmask32>((1u << left) - 1);
}

// How far ahead of its loads the row kernel asks for weights. On Intel's Emerald Rapids
// (2 threads, a 1B model's maps and head at one row) the hardware prefetcher alone read
// 16.8-18.1 GB/s where a plain read loop reads 26; 2 KB ahead 20.7-22.6, 4 KB 21.3-21.6.
constexpr int kDotPrefetchBytes = 4096;

// One weight row against M activation rows, into out[0..M): two independent sums per
// activation row along the weight row, so the adds of one never wait on the other.
template <int M>
inline void dot_row(const uint16_t* w, int64_t k, const uint16_t* x, float* out) {
  __m512 acc[2][M];
  for (int u = 0; u < 2; ++u)
    for (int j = 0; j < M; ++j) acc[u][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    // Past the weights' end (the next rows follow) is harmless: prefetches never fault.
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kDotPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kDotPrefetchBytes + 64, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
    for (int j = 0; j < M; ++j) {
      acc[0][j] = _mm512_dpbf16_ps(acc[0][j], w0, (__m512bh)_mm512_loadu_si512(x + j * k + i));
      acc[1][j] =
          _mm512_dpbf16_ps(acc[1][j], w1, (__m512bh)_mm512_loadu_si512(x + j * k + i + 32));
    }
  }
  for (; i < k; i += 32) {
    const __mmask32 mask = head_mask(k - i);
    const __m512bh ws = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i);
    for (int j = 0; j < M; ++j)
      acc[0][j] = _mm512_dpbf16_ps(acc[0][j], ws,
                                   (__m512bh)_mm512_maskz_loadu_epi16(mask, x + j * k + i));
  }
  for (int j = 0; j < M; ++j) out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]));
}
#elif CBGEN_BF16_AVX2
// 8 bfloat16 weights as float32: the 16 bits on top of a zero low half.
inline __m256 load8(const uint16_t* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

// 16 bfloat16 weights as two float32 vectors by interleaving zeros below them, which
// AVX2 does within each 128-bit half: columns (0-3, 8-11), then (4-7, 12-15). One load
// and two unpacks instead of two loads, two zero-extends and two shifts.
inline __m256 low_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
}
inline __m256 high_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

// The activations [m, k] as float32 with each whole block of 16 columns in the order the
// weights unpack to (above); the last k % 16 columns in order.
void widen_unpacked_order(const uint16_t* x, int64_t m, int64_t k, float* out) {
  static constexpr int kOrder[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = x + r * k;
    float* dst = out + r * k;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
      for (int j = 0; j < 16; ++j) dst[i + j] = c10::detail::f32_from_bits(row[i + kOrder[j]]);
    for (; i < k; ++i) dst[i] = c10::detail::f32_from_bits(row[i]);
  }
}

// AVX2 with FMA, no bfloat16 instructions (AMD Zen 2 and 3, Intel client cores): the
// weights widened to float32 by unpacking, times the activations (xf: float32 [M, k] in
// widen_unpacked_order) in float32 FMAs, four sums per row so the FMAs' latency does not
// bound the loop. Products of two bfloat16 are exact in float32, as with `vdpbf16ps`.
// M is 1 or 2 (16 registers); more rows go two at a time over the same weight row, which
// is then in L1, so each row's sums are the same whatever rows come with it.
//
// The first pass over a weight row also prefetches the weights kPrefetchBytes ahead, one
// cache line an iteration: streaming SmolLM2's maps and LM head at one row on 2 Zen 3
// cores that took 9.2-9.4 ms a step to 8.4-8.7 in a standalone harness (512 bytes ahead:
// 8.8-9.0, 1,536: 9.3-9.6, the hardware prefetcher alone: 9.2-9.4).
constexpr int kPrefetchBytes = 1024;

template <int M, bool Prefetch>
inline void dot_row_pair(const uint16_t* w, int64_t k, const float* xf, float* out) {
  static_assert(M == 1 || M == 2, "one or two activation rows");
  __m256 acc[4][M];
  for (int u = 0; u < 4; ++u)
    for (int j = 0; j < M; ++j) acc[u][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    // A prefetch past the weights' end is harmless: prefetches never fault.
    if constexpr (Prefetch)
      _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 16));
    const __m256 w0 = low_f32(v0), w1 = high_f32(v0), w2 = low_f32(v1), w3 = high_f32(v1);
    for (int j = 0; j < M; ++j) {
      const float* xj = xf + j * k + i;
      acc[0][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xj), acc[0][j]);
      acc[1][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xj + 8), acc[1][j]);
      acc[2][j] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xj + 16), acc[2][j]);
      acc[3][j] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xj + 24), acc[3][j]);
    }
  }
  if (i + 16 <= k) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    const __m256 w0 = low_f32(v0), w1 = high_f32(v0);
    for (int j = 0; j < M; ++j) {
      acc[0][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + j * k + i), acc[0][j]);
      acc[1][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + j * k + i + 8), acc[1][j]);
    }
    i += 16;
  }
  for (int j = 0; j < M; ++j) {
    float sum = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0][j], acc[2][j]),
                                      _mm256_add_ps(acc[1][j], acc[3][j])));
    for (int64_t t = i; t < k; ++t) sum += c10::detail::f32_from_bits(w[t]) * xf[j * k + t];
    out[j] = sum;
  }
}

template <int M>
inline void dot_row(const uint16_t* w, int64_t k, const float* xf, float* out) {
  if constexpr (M <= 2) {
    dot_row_pair<M, true>(w, k, xf, out);
  } else {
    dot_row_pair<2, true>(w, k, xf, out);
    for (int j = 2; j < M; j += 2) {
      if (j + 1 < M) dot_row_pair<2, false>(w, k, xf + j * k, out + j);
      else dot_row_pair<1, false>(w, k, xf + j * k, out + j);
    }
  }
}
#else
template <int M>
inline void dot_row(const uint16_t* w, int64_t k, const uint16_t* x, float* out) {
  for (int j = 0; j < M; ++j) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i)
      sum += c10::detail::f32_from_bits(w[i]) * c10::detail::f32_from_bits(x[j * k + i]);
    out[j] = sum;
  }
}
#endif

template <int M>
void rows_matmul(const uint16_t* w, int64_t n, int64_t k, const uint16_t* x, const float* bias,
                 at::BFloat16* y) {
#if CBGEN_BF16_AVX2
  // The activations widened once, not once per weight row.
  std::vector<float> widened(M * k);
  widen_unpacked_order(x, M, k, widened.data());
  const float* xs = widened.data();
#else
  const uint16_t* xs = x;
#endif
  at::parallel_for(0, (n + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    float sums[M];
    for (int64_t row = begin * kTask; row < std::min(n, end * kTask); ++row) {
      dot_row<M>(w + row * k, k, xs, sums);
      const float add = bias != nullptr ? bias[row] : 0.f;
      for (int j = 0; j < M; ++j) y[j * n + row] = static_cast<at::BFloat16>(sums[j] + add);
    }
  });
}

}  // namespace

// The checks every bf16 entry point makes (this file's two and bf16_fma_matmul): bfloat16
// x [m, k] against a contiguous bfloat16 weight [n, k]; returns the bias as float32
// (undefined when there is none).
at::Tensor checked_bias(const char* name, const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x: bfloat16 [m, k]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous(),
              name, ": weight: contiguous bfloat16 [n, k]");
  TORCH_CHECK(weight.size(1) == x.size(1), name, ": x has ", x.size(1), " columns, weight ",
              weight.size(1));
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == weight.size(0), name, ": bias has ", bias->numel(),
              " values for ", weight.size(0), " outputs");
  return bias->to(at::kFloat).contiguous();
}

bool bf16_rows_available() { return CBGEN_BF16_DOT != 0 || CBGEN_BF16_AVX2 != 0; }

// x: bfloat16 [m, k] with m <= 8; weight: bfloat16 [n, k]; bias: [n] or none.
// Returns bfloat16 [m, n] = x @ weight.T + bias, the bias added in float32 before the
// one rounding to bfloat16, as oneDNN does.
at::Tensor bf16_rows_matmul(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  const at::Tensor bias_f = checked_bias("bf16_rows_matmul", x, weight, bias);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "bf16_rows_matmul takes 1 to ", kMaxRows, " rows, not ", m);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  switch (m) {
    case 1: rows_matmul<1>(w, n, k, xp, bp, y); break;
    case 2: rows_matmul<2>(w, n, k, xp, bp, y); break;
    case 3: rows_matmul<3>(w, n, k, xp, bp, y); break;
    case 4: rows_matmul<4>(w, n, k, xp, bp, y); break;
    case 5: rows_matmul<5>(w, n, k, xp, bp, y); break;
    case 6: rows_matmul<6>(w, n, k, xp, bp, y); break;
    case 7: rows_matmul<7>(w, n, k, xp, bp, y); break;
    default: rows_matmul<8>(w, n, k, xp, bp, y); break;
  }
  return out;
}


// bfloat16 weights times 9 or more bfloat16 rows (PackedMap's routing; it takes any
// number) on AVX2 with FMA, where oneDNN packs no bfloat16 (AMD Zen 2 and 3, Intel
// client cores). Widening chunks of weights to float32 for torch's float32 GEMM (what
// served here before) wrote and re-read every weight as four bytes each step: at 64 rows
// ~35 GMAC/s on 2 Zen 3 cores, where this runs 64-71 (one thread: 32-37 of the core's
// 49) and reads each weight as the two bytes it is.
//
// The rows go in the vector lanes: the activations are widened once a call into a panel
// [row chunk of 24][k][24] float32, and each weight, widened by a shift, is broadcast
// against three vectors of 8 rows. A register tile is 4 weight rows x 24 activation rows
// (12 float32 sums, 3 activation vectors, a broadcast: all 16 of AVX2's registers; fewer
// rows take more weight rows, up to 12 against 8 rows), so no weight is ever transposed
// or copied. Twelve sums are twelve chains of FMAs: with an FMA's 5-cycle latency and
// two issued a cycle, ten keep both pipes busy, where the 2 x 32 tile's eight could not
// (the 2026-12-07 AVX2 EPYC, SmolLM2's maps and head at 64 rows, 2 threads: 166.5-167.8
// -> 140.8-141.9 ms, at 40 rows 121-125 -> 98-99; Gemma 3 270M's at 64 rows 305-307 ->
// 256-261). Each sum runs along k in order, one FMA a column, through every chunk of
// columns (the tile's sums are kept between chunks), so a row's outputs do not depend on
// the rows beside it, nor on the thread count.
#if CBGEN_BF16_AVX2
namespace {

constexpr int64_t kLaneRows = 24;     // activation rows a register tile takes (3 vectors)
constexpr int64_t kColumns = 128;     // columns a tile runs between keeping its sums
constexpr int64_t kBlockRows = 48;    // weight rows a task takes (a multiple of every tile's)
constexpr int64_t kPanelRows = 120;   // activation rows a task's tiles hold at a time

// The FMAs of `width` columns: each column's V activation vectors against the N
// widened weights of that column (wide[n][i]), onto acc.
template <int N, int V>
__attribute__((always_inline)) inline void lanes_columns(__m256 (&acc)[N][V], const float* panel,
                                                         const float (&wide)[N][8], int width) {
  for (int i = 0; i < width; ++i) {
    const float* column = panel + i * kLaneRows;
    __m256 a[V];
    for (int v = 0; v < V; ++v) {
      a[v] = _mm256_loadu_ps(column + v * 8);
      // Kept in a register for the N weights (as memory operands they would be loaded N
      // times, past the core's two vector loads a cycle).
      __asm__("" : "+x"(a[v]));
    }
    for (int n = 0; n < N; ++n) {
      const __m256 b = _mm256_broadcast_ss(&wide[n][i]);
      for (int v = 0; v < V; ++v) acc[n][v] = _mm256_fmadd_ps(b, a[v], acc[n][v]);
    }
  }
}

// N weight rows (row stride k) against V vectors of 8 activation rows (panel: kLaneRows
// float32 a column) over `columns` columns, onto the float32 sums in tile [N][kLaneRows].
template <int N, int V>
inline void lanes_tile(const uint16_t* w, int64_t k, const float* panel, int64_t columns,
                       float* tile, bool first) {
  __m256 acc[N][V];
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v)
      acc[n][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(tile + n * kLaneRows + v * 8);
  alignas(32) float wide[N][8];
  int64_t c = 0;
  for (; c + 8 <= columns; c += 8) {
    for (int n = 0; n < N; ++n) _mm256_store_ps(wide[n], load8(w + n * k + c));
    lanes_columns<N, V>(acc, panel + c * kLaneRows, wide, 8);
  }
  if (c < columns) {
    const int left = static_cast<int>(columns - c);
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < 8; ++i)
        wide[n][i] = i < left ? c10::detail::f32_from_bits(w[n * k + c + i]) : 0.f;
    lanes_columns<N, V>(acc, panel + c * kLaneRows, wide, left);
  }
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(tile + n * kLaneRows + v * 8, acc[n][v]);
}

// Weight rows a tile takes against V vectors of activation rows: 12 float32 sums a tile
// (chains enough for the FMA pipes), so fewer activation vectors share each broadcast
// among more weight rows.
template <int V>
constexpr int kTileWeights = V == 1 ? 12 : V == 2 ? 6 : 4;

template <int V>
void lanes_rows(const uint16_t* w, int64_t k, int64_t rows, const float* panel,
                int64_t columns, float* tiles, bool first) {
  constexpr int N = kTileWeights<V>;
  int64_t n = 0;
  for (; n + N <= rows; n += N)
    lanes_tile<N, V>(w + n * k, k, panel, columns, tiles + n * kLaneRows, first);
  for (; n < rows; ++n)
    lanes_tile<1, V>(w + n * k, k, panel, columns, tiles + n * kLaneRows, first);
}

void lanes_matmul(const uint16_t* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                  const float* bias, at::BFloat16* y) {
  const int64_t chunks = (m + kLaneRows - 1) / kLaneRows;
  // [chunk][k][kLaneRows]; the rows past m in the last chunk are zeros. Every element
  // is written below, so the buffer starts uninitialized.
  const at::Tensor panel_buffer = at::empty({chunks * k * kLaneRows}, at::kFloat);
  float* const panel = panel_buffer.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      float* base = panel + chunk * k * kLaneRows;
      for (int64_t r = 0; r < kLaneRows; ++r) {
        const int64_t row = chunk * kLaneRows + r;
        if (row < m) {
          for (int64_t j = 0; j < k; ++j)
            base[j * kLaneRows + r] = c10::detail::f32_from_bits(x[row * k + j]);
        } else {
          for (int64_t j = 0; j < k; ++j) base[j * kLaneRows + r] = 0.f;
        }
      }
    }
  });
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tiles(kPanelRows * kBlockRows);  // [chunk][weight row][kLaneRows]
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, n - n0);
      for (int64_t m0 = 0; m0 < m; m0 += kPanelRows) {
        const int64_t count = std::min(kPanelRows, m - m0);
        const int64_t held = (count + kLaneRows - 1) / kLaneRows;
        for (int64_t c0 = 0; c0 < k; c0 += kColumns) {
          const int64_t columns = std::min(kColumns, k - c0);
          for (int64_t h = 0; h < held; ++h) {
            const int64_t lanes = std::min(kLaneRows, count - h * kLaneRows);
            const float* p = panel + ((m0 / kLaneRows + h) * k + c0) * kLaneRows;
            float* t = tiles.data() + h * kBlockRows * kLaneRows;
            const uint16_t* wc = w + n0 * k + c0;
            switch ((lanes + 7) / 8) {
              case 1: lanes_rows<1>(wc, k, rows, p, columns, t, c0 == 0); break;
              case 2: lanes_rows<2>(wc, k, rows, p, columns, t, c0 == 0); break;
              default: lanes_rows<3>(wc, k, rows, p, columns, t, c0 == 0); break;
            }
          }
        }
        for (int64_t h = 0; h < held; ++h) {
          const float* t = tiles.data() + h * kBlockRows * kLaneRows;
          for (int64_t r = 0; r < std::min(kLaneRows, count - h * kLaneRows); ++r) {
            at::BFloat16* yr = y + (m0 + h * kLaneRows + r) * n + n0;
            for (int64_t j = 0; j < rows; ++j) {
              const float add = bias != nullptr ? bias[n0 + j] : 0.f;
              yr[j] = static_cast<at::BFloat16>(t[j * kLaneRows + r] + add);
            }
          }
        }
      }
    }
  });
}

}  // namespace
#endif

bool bf16_avx2_available() { return CBGEN_BF16_AVX2 != 0; }

// x: bfloat16 [m, k], any m; weight: bfloat16 [n, k]; bias: [n] or none. Returns
// bfloat16 [m, n] = x @ weight.T + bias, the bias added in float32 before the one
// rounding to bfloat16. AVX2 builds only (elsewhere oneDNN packs bfloat16).
at::Tensor bf16_avx2_matmul(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(CBGEN_BF16_AVX2, "bf16_avx2_matmul: built without AVX2 and FMA, or with "
              "AVX512-BF16 (oneDNN packs bfloat16 there)");
  const at::Tensor bias_f = checked_bias("bf16_avx2_matmul", x, weight, bias);
  const int64_t m = x.size(0), n = weight.size(0);
  [[maybe_unused]] const int64_t k = x.size(1);
  auto out = at::empty({m, n}, x.options());
#if CBGEN_BF16_AVX2
  if (m > 0 && n > 0) {
    auto xc = x.contiguous();
    lanes_matmul(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), m,
                 reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), n, k,
                 bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                 out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}
