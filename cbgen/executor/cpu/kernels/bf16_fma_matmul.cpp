// bfloat16 weights times many bfloat16 rows on AVX-512's float32 FMA units.
//
// oneDNN's bf16 GEMMs on a CPU without AMX are built on `vdpbf16ps`. How fast that
// instruction is depends on the core: on AMD Zen 4 it does twice the float32 FMA's
// work a cycle, but on Intel's Sapphire/Emerald Rapids cores it issues once every two
// cycles while two float32 FMAs issue every cycle, so there the float32 units have
// twice its throughput (independent loops on one core of a 2026-12-07 Xeon, model 207:
// `vdpbf16ps` 92 GFLOP/s, `vfmadd231ps` 188), and torch's float32 F.linear beat its
// bfloat16 one by 1.4-1.9x at 64 and 256 rows on the same weights. `bf16_dot_fma_rates`
// measures both instructions so the caller can pick the kernel that suits the core.
//
// This kernel keeps the weights as they are ([n, k] bfloat16, the same copy the row
// kernel reads) and puts the activation rows in the vector lanes: the activations are
// widened once a call into a panel [chunk of 64 rows][k][64] float32, and each weight,
// widened by a shift, is broadcast against four vectors of 16 rows. A register tile is 6
// weight rows x 64 activation rows (24 float32 sums, 4 activation vectors and a
// broadcast of AVX-512's 32 registers; fewer rows take more weight rows), so no weight
// is transposed or copied beyond a 16-column strip. Products of two bfloat16 are exact
// in float32, as in `vdpbf16ps`; each sum runs along k in order, one FMA a column,
// through every chunk of columns, so a row's outputs do not depend on the rows beside
// it, nor on the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define CBGEN_BF16_FMA512 1
#else
#define CBGEN_BF16_FMA512 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define CBGEN_BF16_DOT_PROBE 1
#else
#define CBGEN_BF16_DOT_PROBE 0
#endif

namespace {

#if CBGEN_BF16_FMA512
constexpr int64_t kLaneRows = 64;    // activation rows a register tile takes (4 vectors)
constexpr int64_t kColumns = 128;    // columns a tile runs between keeping its sums
constexpr int64_t kBlockRows = 96;   // weight rows a task takes (a multiple of every tile's)
constexpr int64_t kPanelRows = 128;  // activation rows a task's tiles hold at a time

// 16 bfloat16 as float32: each 16-bit value above 16 zero bits.
inline __m512 widen16(const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
}
inline __m512 widen_masked(const uint16_t* w, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w)), 16));
}

// The FMAs of `width` columns: each column's V activation vectors against the N
// widened weights of that column (wide[n][i]), onto acc.
template <int N, int V>
__attribute__((always_inline)) inline void lanes_columns(__m512 (&acc)[N][V], const float* panel,
                                                         const float (*wide)[kColumns],
                                                         int64_t width) {
  for (int64_t i = 0; i < width; ++i) {
    const float* column = panel + i * kLaneRows;
    __m512 a[V];
    for (int v = 0; v < V; ++v) {
      a[v] = _mm512_loadu_ps(column + v * 16);
      // Kept in a register for the N weights (as memory operands they would be loaded N
      // times, past the core's vector loads a cycle).
      __asm__("" : "+v"(a[v]));
    }
    for (int n = 0; n < N; ++n) {
      const __m512 b = _mm512_set1_ps(wide[n][i]);
      for (int v = 0; v < V; ++v) acc[n][v] = _mm512_fmadd_ps(b, a[v], acc[n][v]);
    }
  }
}

// N weight rows (row stride k) against V vectors of 16 activation rows (panel: kLaneRows
// float32 a column) over `columns` (at most kColumns) columns, onto the float32 sums in
// tile [N][kLaneRows]. The weights of all the columns are widened first, so the FMAs
// then run without a break (widening 16 columns at a time between them ran slower).
template <int N, int V>
inline void lanes_tile(const uint16_t* w, int64_t k, const float* panel, int64_t columns,
                       float* tile, bool first) {
  alignas(64) float wide[N][kColumns];
  for (int n = 0; n < N; ++n) {
    int64_t c = 0;
    for (; c + 16 <= columns; c += 16) _mm512_store_ps(wide[n] + c, widen16(w + n * k + c));
    if (c < columns) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (columns - c)) - 1);
      _mm512_store_ps(wide[n] + c, widen_masked(w + n * k + c, mask));
    }
  }
  // The next tile's weights (the N rows below, same columns) are short runs of cache
  // lines a row apart, which the hardware prefetcher does not follow: asked for here,
  // they arrive while this tile's FMAs run instead of stalling the next tile's start
  // (all the 1B shape's maps and head at 64 rows, 2 threads: 245 -> 268-286 GFLOP/s;
  // SmolLM2's 212-253 -> 292).
  for (int n = 0; n < N; ++n)
    for (int64_t c = 0; c < columns; c += 32)
      _mm_prefetch(reinterpret_cast<const char*>(w + (N + n) * k + c), _MM_HINT_T0);
  __m512 acc[N][V];
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v)
      acc[n][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(tile + n * kLaneRows + v * 16);
  lanes_columns<N, V>(acc, panel, wide, columns);
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(tile + n * kLaneRows + v * 16, acc[n][v]);
}

// Weight rows a tile takes against V vectors of activation rows: 24 float32 sums a tile
// (chains enough for two FMA pipes of 4 cycles' latency) while V + N + 24 registers
// fit in 32, else as many as fit.
template <int V>
constexpr int kTileWeights = V == 1 ? 12 : V == 2 ? 12 : V == 3 ? 8 : 6;

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

// float32 to bfloat16 as c10's conversion rounds (to nearest, ties to even; NaN to
// the quiet 0x7FC0), 16 at a time. `vcvtneps2bf16` would flush denormal results to
// zero, which c10 does not.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(
      _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

// A 16 x 16 block of a tile (t[j * kLaneRows + r]: weight row j, activation row r) to
// the output (y[r * n + j]) with the bias added, for the first `width` weight rows and
// `height` activation rows: a transpose in registers, so the outputs go out 16 a store
// (one at a time, the write-back took a fifth of a call at SmolLM2's 576 columns).
inline void store_transposed(const float* t, int64_t width, int64_t height, const float* bias,
                             at::BFloat16* y, int64_t n) {
  __m512 a[16], b[16];
  for (int j = 0; j < 16; ++j)
    a[j] = j < width ? _mm512_loadu_ps(t + j * kLaneRows) : _mm512_setzero_ps();
  // Pairs, then quads of 32-bit lanes, then 128-bit quarters, then halves.
  for (int j = 0; j < 16; j += 2) {
    b[j] = _mm512_unpacklo_ps(a[j], a[j + 1]);
    b[j + 1] = _mm512_unpackhi_ps(a[j], a[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {
    a[j] = _mm512_shuffle_ps(b[j], b[j + 2], 0x44);
    a[j + 1] = _mm512_shuffle_ps(b[j], b[j + 2], 0xEE);
    a[j + 2] = _mm512_shuffle_ps(b[j + 1], b[j + 3], 0x44);
    a[j + 3] = _mm512_shuffle_ps(b[j + 1], b[j + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    b[j] = _mm512_shuffle_f32x4(a[j], a[j + 4], 0x88);
    b[j + 4] = _mm512_shuffle_f32x4(a[j], a[j + 4], 0xDD);
    b[j + 8] = _mm512_shuffle_f32x4(a[j + 8], a[j + 12], 0x88);
    b[j + 12] = _mm512_shuffle_f32x4(a[j + 8], a[j + 12], 0xDD);
  }
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm512_shuffle_f32x4(b[j], b[j + 8], 0x88);
    a[j + 8] = _mm512_shuffle_f32x4(b[j], b[j + 8], 0xDD);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  // a[r] now holds activation row r of the block, weight rows in its lanes.
  for (int r = 0; r < height; ++r)
    _mm256_mask_storeu_epi16(y + r * n, mask, round_to_bf16(_mm512_add_ps(a[r], add)));
}

void lanes_matmul(const uint16_t* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                  const float* bias, at::BFloat16* y) {
  const int64_t chunks = (m + kLaneRows - 1) / kLaneRows;
  // [chunk][k][kLaneRows]; the rows past m in the last chunk are zeros. Every element
  // is written below, so the buffer starts uninitialized.
  const at::Tensor panel_buffer = at::empty({chunks * k * kLaneRows}, at::kFloat);
  float* const panel = panel_buffer.data_ptr<float>();
  // Built by both threads a slice of columns each: at 64 rows one chunk is the whole
  // panel, and one thread building it left the other idle for up to a tenth of a call.
  const int64_t slices = (k + kColumns - 1) / kColumns;
  at::parallel_for(0, chunks * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t chunk = unit / slices, j0 = (unit % slices) * kColumns;
      const int64_t rows = std::min(kLaneRows, m - chunk * kLaneRows);
      const uint16_t* xs = x + chunk * kLaneRows * k;
      for (int64_t j = j0; j < std::min(k, j0 + kColumns); ++j) {
        float* column = panel + (chunk * k + j) * kLaneRows;
        for (int64_t r = 0; r < rows; ++r) column[r] = c10::detail::f32_from_bits(xs[r * k + j]);
        for (int64_t r = rows; r < kLaneRows; ++r) column[r] = 0.f;
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
            switch ((lanes + 15) / 16) {
              case 1: lanes_rows<1>(wc, k, rows, p, columns, t, c0 == 0); break;
              case 2: lanes_rows<2>(wc, k, rows, p, columns, t, c0 == 0); break;
              case 3: lanes_rows<3>(wc, k, rows, p, columns, t, c0 == 0); break;
              default: lanes_rows<4>(wc, k, rows, p, columns, t, c0 == 0); break;
            }
          }
        }
        for (int64_t h = 0; h < held; ++h) {
          const float* t = tiles.data() + h * kBlockRows * kLaneRows;
          const int64_t lanes = std::min(kLaneRows, count - h * kLaneRows);
          for (int64_t r0 = 0; r0 < lanes; r0 += 16)
            for (int64_t j0 = 0; j0 < rows; j0 += 16)
              store_transposed(t + j0 * kLaneRows + r0, std::min<int64_t>(16, rows - j0),
                               std::min<int64_t>(16, lanes - r0), bias ? bias + n0 + j0 : nullptr,
                               y + (m0 + h * kLaneRows + r0) * n + n0 + j0, n);
        }
      }
    }
  });
}
#endif

// Seconds one thread takes for `loops` x 12 independent instructions of `Op`.
template <typename Op>
double time_loop(int64_t loops, Op op) {
  const auto start = std::chrono::steady_clock::now();
  op(loops);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// bf16_matmul.cpp's argument checks, shared by its kernels and this one.
at::Tensor checked_bias(const char* name, const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias);

bool bf16_fma_available() { return CBGEN_BF16_FMA512 != 0; }

// GFLOP/s of one thread issuing independent `vdpbf16ps` (64 flops each) and independent
// `vfmadd231ps` (32 flops each) on 512-bit registers, the better of three short runs
// (about a millisecond each); 0 for an instruction this build lacks.
std::vector<double> bf16_dot_fma_rates() {
  constexpr int64_t kLoops = 100000;
  double dot = 0.0, fma = 0.0;
#if CBGEN_BF16_FMA512
  for (int run = 0; run < 3; ++run) {
    const double fma_s = time_loop(kLoops, [](int64_t loops) {
      __m512 acc[12];
      for (auto& a : acc) a = _mm512_setzero_ps();
      __m512 x = _mm512_set1_ps(1e-3f);
      for (int64_t i = 0; i < loops; ++i) {
        for (auto& a : acc) a = _mm512_fmadd_ps(x, x, a);
        __asm__ volatile("" : "+v"(x));
      }
      for (auto& a : acc) __asm__ volatile("" : : "v"(a));
    });
    fma = std::max(fma, kLoops * 12.0 * 32 / fma_s / 1e9);
#if CBGEN_BF16_DOT_PROBE
    const double dot_s = time_loop(kLoops, [](int64_t loops) {
      __m512 acc[12];
      for (auto& a : acc) a = _mm512_setzero_ps();
      __m512bh x = (__m512bh)_mm512_set1_epi16(0x3a83);
      for (int64_t i = 0; i < loops; ++i) {
        for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, x);
        __asm__ volatile("" : "+v"(x));
      }
      for (auto& a : acc) __asm__ volatile("" : : "v"(a));
    });
    dot = std::max(dot, kLoops * 12.0 * 64 / dot_s / 1e9);
#endif
  }
#endif
  return {dot, fma};
}

// x: bfloat16 [m, k], any m; weight: contiguous bfloat16 [n, k]; bias: [n] or none.
// Returns bfloat16 [m, n] = x @ weight.T + bias, the bias added in float32 before the
// one rounding to bfloat16, as oneDNN does. AVX-512 builds only.
at::Tensor bf16_fma_matmul(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(CBGEN_BF16_FMA512, "bf16_fma_matmul: built without AVX-512");
  const at::Tensor bias_f = checked_bias("bf16_fma_matmul", x, weight, bias);
  const int64_t m = x.size(0), n = weight.size(0);
  [[maybe_unused]] const int64_t k = x.size(1);
  auto out = at::empty({m, n}, x.options());
#if CBGEN_BF16_FMA512
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
