// 4-bit weights times bfloat16 rows: with the activations rounded to int8 (w4a8,
// AVX512-VNNI or AVX2, here), or as they are (int4, AVX512-BF16, further down), or
// rounded to int16 (int4 on AVX2-only CPUs, at the end).
//
// torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) widens every 4-bit code to
// float and multiplies it by a bfloat16 activation: about 10 vector instructions per
// 16 bytes of codes, so on 2 cores it reads weights at ~23 GB/s, where llama.cpp's Q4
// kernels read ~33 GB/s on the same machine. This kernel does what llama.cpp does:
// each row's activations are quantized to int8 per group of 32 (one scale a group), and
// `vpdpbusd` multiplies 64 unsigned 4-bit codes by 64 signed int8 activations and adds
// them in four int32 sums in one instruction; the group's float scale and minimum are
// applied once per group.
//
// Weight layout (built by int4_vnni_pack): rows in blocks of 16, so one int32 lane of a
// 512-bit register belongs to one output row. For block b, group g and quad pair p
// (0..3), 64 bytes hold, for row r of the block, bytes 4r..4r+3: code k = 4p + i in the
// low nibble of byte i and code k = 16 + 4p + i in its high nibble (k counted within
// the group). Each group's 16 scales and then 16 minima are bfloat16, 64 bytes
// [blocks, groups, 32]: with the codes that is 0.625 bytes a weight (float32 scales
// made it 0.75; llama.cpp's Q4_0 is 0.5625).
//
//   y[m, n] = sum_g scale[n, g] * dx[m, g] * sum_k code[n, g, k] * xq[m, g, k]
//           + minimum[n, g] * sum_k x[m, g, k]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CBGEN_INT4_VNNI 1
#define CBGEN_W4A8_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define CBGEN_INT4_VNNI 0
#define CBGEN_W4A8_AVX2 1
#else
#define CBGEN_INT4_VNNI 0
#define CBGEN_W4A8_AVX2 0
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 16;

// Each group's plain float32 sum of one row of bfloat16 activations: the term that
// multiplies the minima (and, in the bf16 kernel, the 2 its codes carry).
void group_sums(const uint16_t* x, int64_t k, int64_t group, float* sums) {
  for (int64_t g = 0; g < k / group; ++g) {
    float s = 0.f;
    for (int64_t i = 0; i < group; ++i) s += c10::detail::f32_from_bits(x[g * group + i]);
    sums[g] = s;
  }
}

// One row of activations as int8 codes per group of 32 and their scales.
void quantize_row(const uint16_t* x, int64_t k, int8_t* xq, float* dx) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    float values[kGroup];
    float amax = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      values[i] = c10::detail::f32_from_bits(x[g * kGroup + i]);
      amax = std::max(amax, std::fabs(values[i]));
    }
    // A group of zeros (or of denormals, whose inverse scale would overflow) gets no
    // codes; its exact sum still multiplies the minima.
    const float scale = amax / 127.f;
    const float inv = scale >= FLT_MIN ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      xq[g * kGroup + i] = static_cast<int8_t>(std::nearbyint(values[i] * inv));
    }
    dx[g] = scale;
  }
}

#if defined(__AVX2__)
// Eight bfloat16 to float32: the 16 bits on top of a zero low half.
inline __m256 bf16x8(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// What both matmuls check of their inputs. Returns the columns per scale group (a
// multiple of 32: the packed codes come in groups of 32, the scales may span several).
int64_t check_4bit_inputs(const char* name, const at::Tensor& x, const at::Tensor& packed,
                          std::vector<int64_t> layout, const at::Tensor& scales_minima) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be bfloat16 [m, k]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == layout[0] && packed.size(3) == layout[1] &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              name, ": packed must be its pack's uint8 [n / 16, k / 32, ", layout[0], ", ",
              layout[1], "]");
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == x.size(1), name, ": k does not match the packed weights");
  TORCH_CHECK(scales_minima.scalar_type() == at::kBFloat16 && scales_minima.is_contiguous() &&
                  scales_minima.dim() == 3 && scales_minima.size(0) == blocks &&
                  scales_minima.size(2) == 2 * kBlock && scales_minima.size(1) > 0 &&
                  groups % scales_minima.size(1) == 0,
              name, ": scales and minima must be bfloat16 [n / 16, k / group, 32] with the group "
              "a multiple of 32 that divides k");
  return kGroup * (groups / scales_minima.size(1));
}

// Each block's and group's 16 scales then 16 minima, bfloat16: [blocks, groups, 32].
at::Tensor pack_scales_minima(const at::Tensor& scales, const at::Tensor& minima, int64_t blocks,
                              int64_t groups) {
  auto reblock = [&](const at::Tensor& t) {
    return t.to(at::kBFloat16).reshape({blocks, kBlock, groups}).transpose(1, 2);
  };
  return at::cat({reblock(scales), reblock(minima)}, 2).contiguous();
}

// codes: uint8 [n, k] in 0..15 to [n / 16, k / 32, layout...] (256 bytes a block and
// group of 32), with place(out, r, code) writing row r's 32 codes of a group (code(j),
// j < 32) into its block's 256 bytes; then pack_scales_minima, one pair a row per scale
// group (k / scales.size(1) columns, a multiple of 32). With nibbles, codes are
// [n, k / 2], two a byte (column 2j in the low nibble of byte j): quantize_4bit's and
// QuantizedLinear's form, packed without widening every code to a byte first.
template <typename Place>
std::vector<at::Tensor> pack_4bit(const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& minima, bool nibbles,
                                  std::vector<int64_t> layout, const char* name, Place place) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, name,
              nibbles ? ": codes uint8 [n, k / 2]" : ": codes uint8 [n, k]");
  const int64_t n = codes.size(0), k = codes.size(1) * (nibbles ? 2 : 1);
  TORCH_CHECK(n % kBlock == 0 && k % kGroup == 0, name, ": n % 16 or k % 32 != 0");
  const int64_t groups = k / kGroup, blocks = n / kBlock;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) > 0 &&
                  groups % scales.size(1) == 0 && minima.sizes() == scales.sizes(),
              name, ": scales and minima [n, k / group] with the group a multiple of 32");
  auto c = codes.contiguous();
  std::vector<int64_t> shape = {blocks, groups};
  shape.insert(shape.end(), layout.begin(), layout.end());
  auto packed = at::empty(shape, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  const int64_t row_bytes = c.size(1);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < kBlock; ++r) {
          const uint8_t* row = src + (b * kBlock + r) * row_bytes;
          uint8_t* out = dst + (b * groups + g) * 256;
          if (nibbles) {
            const uint8_t* two = row + g * kGroup / 2;
            place(out, r, [two](int64_t j) { return (two[j >> 1] >> (4 * (j & 1))) & 15; });
          } else {
            const uint8_t* one = row + g * kGroup;
            place(out, r, [one](int64_t j) { return one[j] & 15; });
          }
        }
      }
    }
  });
  return {packed, pack_scales_minima(scales, minima, blocks, scales.size(1))};
}

// One block of 16 output rows of an int4_bf16_pack-layout kernel against the m
// activation rows, Tile at a time: tile(wb, smb, row, rows, acc) leaves rows x 16
// float32 sums in acc, which go to block b's columns of y [m, blocks * 16] as bfloat16.
template <int Tile, typename TileFn>
void one_block(int64_t m, int64_t b, int64_t blocks, int64_t groups, int64_t scale_groups,
               const uint8_t* w, const uint16_t* sm, at::BFloat16* y, TileFn& tile) {
  const int64_t n = blocks * kBlock;
  float acc[Tile * kBlock];
  const uint8_t* wb = w + b * groups * 256;
  const uint16_t* smb = sm + b * scale_groups * 2 * kBlock;
  for (int64_t row = 0; row < m; row += Tile) {
    const int64_t rows = std::min<int64_t>(Tile, m - row);
    tile(wb, smb, row, rows, acc);
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* yr = y + (row + r) * n + b * kBlock;
#if CBGEN_VFLOAT
      // c10's rounding a vector at a time: 16 scalar conversions were about a
      // twentieth of a one-row tile's instructions.
      for (int64_t c = 0; c < kBlock; c += kWidth)
        vstore_bf16(yr + c, vload(acc + r * kBlock + c));
#else
      for (int64_t c = 0; c < kBlock; ++c) yr[c] = static_cast<at::BFloat16>(acc[r * kBlock + c]);
#endif
    }
  }
}

// The outer loop of the int4_bf16_pack-layout kernels: every block (split across
// threads) through one_block.
template <int Tile, typename TileFn>
void for_each_block(int64_t m, int64_t blocks, int64_t groups, int64_t scale_groups,
                    const uint8_t* w, const uint16_t* sm, at::BFloat16* y, TileFn tile) {
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      one_block<Tile>(m, b, blocks, groups, scale_groups, w, sm, y, tile);
  });
}

// The grouped calls' spans: a count, weights and scales each, the counts adding up to
// x's rows, every span's weights of one shape (and each its kernel's, checked there).
void check_spans(const char* name, const at::Tensor& x, const std::vector<int64_t>& counts,
                 const std::vector<at::Tensor>& packed,
                 const std::vector<at::Tensor>& scales_minima) {
  TORCH_CHECK(!packed.empty() && counts.size() == packed.size() &&
                  scales_minima.size() == packed.size(),
              name, ": one count, packed and scales_minima a span");
  int64_t total = 0;
  for (int64_t count : counts) {
    TORCH_CHECK(count >= 0, name, ": a negative count");
    total += count;
  }
  TORCH_CHECK(x.dim() == 2 && total == x.size(0), name, ": the counts do not add up to x's rows");
  for (size_t i = 1; i < packed.size(); ++i) {
    TORCH_CHECK(packed[i].sizes() == packed[0].sizes() &&
                    scales_minima[i].sizes() == scales_minima[0].sizes(),
                name, ": every span's weights must be of one shape");
  }
}

// A grouped call's span with rows: where its rows start in x, how many, its weights.
struct Span {
  int64_t start, rows;
  const uint8_t* w;
  const uint16_t* sm;
};

std::vector<Span> nonempty_spans(const std::vector<int64_t>& counts,
                                 const std::vector<at::Tensor>& packed,
                                 const std::vector<at::Tensor>& scales_minima) {
  std::vector<Span> spans;
  int64_t start = 0;
  for (size_t i = 0; i < packed.size(); start += counts[i], ++i) {
    if (counts[i] == 0) continue;
    spans.push_back({start, counts[i], packed[i].data_ptr<uint8_t>(),
                     reinterpret_cast<const uint16_t*>(scales_minima[i].data_ptr<at::BFloat16>())});
  }
  return spans;
}

}  // namespace

bool int4_vnni_available() { return CBGEN_INT4_VNNI || CBGEN_W4A8_AVX2; }

#if CBGEN_W4A8_AVX2
namespace {

// w4a8 on AVX2 (no VNNI): int4_vnni_pack's layout, whose 64 bytes of a quad pair are
// rows 0-7 in their low 32 and rows 8-15 in their high 32, 4 bytes a row. `vpmaddubsw`
// multiplies 32 unsigned codes by 32 signed int8 activations and adds adjacent pairs
// into int16: a row's 4 bytes give 2 words, and eight such sums (a group's 32 codes)
// stay below 8 * 2 * 15 * 127 = 30,480, so they add up in int16 with no saturation
// and `vpmaddwd` by ones makes each row's int32 dot once a group. That is half the
// multiplies of the int4 AVX2 kernel's `vpmaddwd` on int16 activations, and a group's
// float arithmetic is the VNNI kernel's, in its order: the same int32 dot, the same
// float32 result.
//
// R rows of int8 activations (xq, row stride k; dx and sx, row stride groups) against
// one block of 16 output rows; out gets R x 16 float32. The caller passes four rows at a
// time: about 5% more products a second than two on a Zen 3 core.
template <int R>
void w4a8_avx2_block(const uint8_t* wb, const uint16_t* smb, int64_t groups, const int8_t* xq,
                     int64_t k, const float* dx, const float* sx, float* out) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wb + g * 256;
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* xg = xq + r * k + g * kGroup;
          int32_t quad_lo, quad_hi;
          std::memcpy(&quad_lo, xg + 4 * p, 4);
          std::memcpy(&quad_hi, xg + 16 + 4 * p, 4);
          dot[r][h] = _mm256_add_epi16(dot[r][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad_lo)));
          dot[r][h] = _mm256_add_epi16(dot[r][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad_hi)));
        }
      }
    }
    const uint16_t* smg = smb + g * 2 * kBlock;
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(smg + 8 * h)));
      const __m256 minimum =
          bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(smg + kBlock + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256i sum = _mm256_madd_epi16(dot[r][h], ones);
        total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                      _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * groups + g])),
                                      total[r][h]);
        total[r][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(sx[r * groups + g]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kBlock, total[r][0]);
    _mm256_storeu_ps(out + r * kBlock + 8, total[r][1]);
  }
}

}  // namespace
#endif

// codes: uint8 [n, k] in 0..15 (with nibbles [n, k / 2], two a byte); scales, minima:
// float32 [n, k / 32]. Returns (packed uint8 [n / 16, k / 32, 4, 64], scales then minima
// bfloat16 [n / 16, k / 32, 32]).
std::vector<at::Tensor> int4_vnni_pack(const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& minima, bool nibbles) {
  const int64_t k = codes.size(1) * (nibbles ? 2 : 1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(1) * kGroup == k,
              "int4_vnni_pack: w4a8 scales groups of 32");
  return pack_4bit(codes, scales, minima, nibbles, {4, 64}, "int4_vnni_pack",
                   [](uint8_t* out, int64_t r, auto code) {
                     for (int64_t p = 0; p < 4; ++p) {
                       for (int64_t i = 0; i < 4; ++i) {
                         out[p * 64 + 4 * r + i] =
                             static_cast<uint8_t>(code(4 * p + i) | (code(16 + 4 * p + i) << 4));
                       }
                     }
                   });
}

// Consecutive spans of x's rows (counts[i] rows each), span i against its own w4a8
// weights (packed[i], scales_minima[i]; all of one shape), in one call and one parallel
// loop over every (span, block): an MoE layer's experts. Each row is quantized once, as
// int4_vnni_matmul quantizes it, so every span's rows get the bits that call would give
// them. x: bfloat16 [m, k]; returns bfloat16 [m, n].
at::Tensor int4_vnni_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const std::vector<at::Tensor>& packed,
                             const std::vector<at::Tensor>& scales_minima) {
  check_spans("int4_vnni_grouped", x, counts, packed, scales_minima);
  const int64_t group =
      check_4bit_inputs("int4_vnni_matmul", x, packed[0], {4, 64}, scales_minima[0]);
  for (size_t i = 1; i < packed.size(); ++i)
    check_4bit_inputs("int4_vnni_matmul", x, packed[i], {4, 64}, scales_minima[i]);
  TORCH_CHECK(group == kGroup, "int4_vnni_matmul: w4a8 scales groups of 32");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = packed[0].size(0), groups = packed[0].size(1);
  const int64_t n = blocks * kBlock;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * groups), sx(m * groups);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      quantize_row(xp + row * k, k, xq.data() + row * k, dx.data() + row * groups);
      group_sums(xp + row * k, k, kGroup, sx.data() + row * groups);
    }
  });
  const std::vector<Span> spans = nonempty_spans(counts, packed, scales_minima);
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  const int64_t work = static_cast<int64_t>(spans.size()) * blocks;
  at::parallel_for(0, work, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Span& span = spans[item / blocks];
      const int64_t b = item % blocks;
#if CBGEN_W4A8_AVX2
      auto tile = [&](const uint8_t* wb, const uint16_t* smb, int64_t row, int64_t rows,
                      float* acc) {
        const int64_t at = span.start + row;
        const int8_t* xr = xq.data() + at * k;
        const float* dr = dx.data() + at * groups;
        const float* sr = sx.data() + at * groups;
        switch (rows) {
          case 1: w4a8_avx2_block<1>(wb, smb, groups, xr, k, dr, sr, acc); break;
          case 2: w4a8_avx2_block<2>(wb, smb, groups, xr, k, dr, sr, acc); break;
          case 3: w4a8_avx2_block<3>(wb, smb, groups, xr, k, dr, sr, acc); break;
          default: w4a8_avx2_block<4>(wb, smb, groups, xr, k, dr, sr, acc); break;
        }
      };
      one_block<4>(span.rows, b, blocks, groups, groups, span.w, span.sm, y + span.start * n,
                   tile);
#else
      const uint8_t* wb = span.w + b * groups * 256;
      const uint16_t* smb = span.sm + b * groups * 2 * kBlock;
      for (int64_t row = span.start; row < span.start + span.rows; ++row) {
        const int8_t* xr = xq.data() + row * k;
        const float* dr = dx.data() + row * groups;
        const float* sr = sx.data() + row * groups;
        float acc[kBlock];
#if CBGEN_INT4_VNNI
        const __m512i low = _mm512_set1_epi8(15);
        __m512 total = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* wg = wb + g * 256;
          int32_t xg[8];  // the group's 32 int8 codes as 8 quads
          std::memcpy(xg, xr + g * kGroup, sizeof(xg));
          __m512i dot = _mm512_setzero_si512();
          for (int p = 0; p < 4; ++p) {
            const __m512i v = _mm512_loadu_si512(wg + p * 64);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            dot = _mm512_dpbusd_epi32(dot, lo, _mm512_set1_epi32(xg[p]));
            dot = _mm512_dpbusd_epi32(dot, hi, _mm512_set1_epi32(xg[4 + p]));
          }
          // bfloat16 to float32: the 16 bits on top of a zero low half.
          const __m512i both = _mm512_loadu_si512(smb + g * 2 * kBlock);
          const __m512 scale = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(both)), 16));
          const __m512 minimum = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1)), 16));
          total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                  _mm512_mul_ps(scale, _mm512_set1_ps(dr[g])), total);
          total = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sr[g]), total);
        }
        _mm512_storeu_ps(acc, total);
#else
        for (int64_t r = 0; r < kBlock; ++r) acc[r] = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* wg = wb + g * 256;
          const int8_t* xg = xr + g * kGroup;
          for (int64_t r = 0; r < kBlock; ++r) {
            int32_t dot = 0;
            for (int p = 0; p < 4; ++p) {
              for (int i = 0; i < 4; ++i) {
                const uint8_t byte = wg[p * 64 + 4 * r + i];
                dot += static_cast<int32_t>(byte & 15) * xg[4 * p + i];
                dot += static_cast<int32_t>(byte >> 4) * xg[16 + 4 * p + i];
              }
            }
            const uint16_t* smg = smb + g * 2 * kBlock;
            acc[r] += static_cast<float>(dot) * (c10::detail::f32_from_bits(smg[r]) * dr[g]);
            acc[r] += c10::detail::f32_from_bits(smg[kBlock + r]) * sr[g];
          }
        }
#endif
        at::BFloat16* yr = y + row * n + b * kBlock;
        for (int64_t r = 0; r < kBlock; ++r) yr[r] = static_cast<at::BFloat16>(acc[r]);
      }
#endif
    }
  });
  return out;
}

// x: bfloat16 [m, k]; returns bfloat16 [m, n].
at::Tensor int4_vnni_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima) {
  return int4_vnni_grouped(x, {x.size(0)}, {packed}, {scales_minima});
}

// 4-bit weights times bfloat16 activations with AVX512-BF16 (the "int4" mode): no
// activation rounding, so it keeps int4's quality.
//
// `vdpbf16ps` multiplies bfloat16 pairs, so each code has to become a bfloat16 first. A
// code c (0..15) in the low bits of a 16-bit word under 0x4000 is the bfloat16 of
// 2 + c / 64, exactly: zero-extending 32 bytes of codes to words and one ternary-logic
// op (the low nibbles) or one double shift (`vpshrdw`, the high nibbles) make 64
// weights ready to multiply. The 2 and the 1/64 come back out per group with the
// activations' sum: sum_k x_k (2 + c_k / 64) = (sum_k x_k c_k) / 64 + 2 sum_k x_k, so
//
//   y[m, n] = sum_g 64 scale[n, g] * D[m, n, g] + (minimum[n, g] - 128 scale[n, g]) * S[m, g]
//
// over the scale groups g, with D the group's dot product of x against 2 + code / 64 and S its activation sum,
// both float32.
//
// Weight layout (int4_bf16_pack): rows in blocks of 16, one 32-bit lane of a register a
// row. For block b, group g and pair q (0..7), 32 bytes: byte 2r + t holds code k = 2q + t
// of row r in its low nibble and code k = 16 + 2q + t in its high nibble (k within the
// group). So one register's lane r holds row r's codes for two adjacent k, and the
// activations for it are one 32-bit broadcast (an operand of `vdpbf16ps` itself). The
// scales and minima are laid out as int4_vnni_pack's, but a scale group may span 32,
// 64, 128 or 256 columns (the codes' groups of 32 add up first): 0.625, 0.5625,
// 0.53125 or 0.515625 bytes a weight in all (llama.cpp's Q4_0 is 0.5625, Q4_1 0.625).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI2__)
#define CBGEN_INT4_BF16 1
#else
#define CBGEN_INT4_BF16 0
#endif

bool int4_bf16_available() { return CBGEN_INT4_BF16 != 0; }

// codes: uint8 [n, k] in 0..15 (with nibbles [n, k / 2], two a byte); scales, minima:
// float32 [n, k / group], the group a multiple of 32. Returns (packed uint8 [n / 16,
// k / 32, 8, 32], scales then minima bfloat16 [n / 16, k / group, 32]).
std::vector<at::Tensor> int4_bf16_pack(const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& minima, bool nibbles) {
  return pack_4bit(codes, scales, minima, nibbles, {8, 32}, "int4_bf16_pack",
                   [](uint8_t* out, int64_t r, auto code) {
                     for (int64_t q = 0; q < 8; ++q) {
                       for (int64_t t = 0; t < 2; ++t) {
                         out[q * 32 + 2 * r + t] =
                             static_cast<uint8_t>(code(2 * q + t) | (code(16 + 2 * q + t) << 4));
                       }
                     }
                   });
}

#if CBGEN_INT4_BF16
namespace {

// Each group's codes are also prefetched this far ahead (the next lines of the thread's
// run of blocks, which lie end to end): with the hardware prefetcher alone the 1B shape's
// 4-bit maps and int8 head read 15 GB/s at one row on the 2026-12-07 Intel Xeon (2
// threads), where the bfloat16 row kernel, prefetching the same way, reads 26-30.
constexpr int64_t kInt4PrefetchBytes = 4096;

// R rows of activations (x, row stride k; S their sums per scale group, row stride
// scale_groups) against one block of 16 output rows; out gets R x 16 float32. A scale
// group spans `per` groups of 32 codes: their dot products add up before its scale.
template <int R>
void int4_bf16_block(const uint8_t* wb, const uint16_t* smb, int64_t scale_groups, int64_t per,
                     const uint16_t* x, int64_t k, const float* sums, float* out) {
  // A few rows keep four chains of vdpbf16ps a row, so consecutive ones do not wait on
  // each other; four rows are chains enough with two.
  constexpr int kChains = R <= 2 ? 4 : 2;
  const __m512i low = _mm512_set1_epi16(15);
  const __m512i exponent = _mm512_set1_epi16(0x4000);
  const __m512i exponent_nibble = _mm512_set1_epi16(4);  // 4 << 12 == 0x4000
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t sg = 0; sg < scale_groups; ++sg) {
    __m512 dot[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_ps();
    }
    for (int64_t g = sg * per; g < (sg + 1) * per; ++g) {
      const uint8_t* wg = wb + g * 256;
      // Past the weights' end is harmless: prefetches never fault.
      for (int line = 0; line < 256; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg) + kInt4PrefetchBytes + line, _MM_HINT_T0);
      for (int q = 0; q < 8; ++q) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wg + q * 32)));
        // (w & 15) | 0x4000, and (w >> 4) with 4 shifted in on top: 0x4000 | (w >> 4).
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, low, exponent, 0xEA);
        const __m512bh hi = (__m512bh)_mm512_shrdi_epi16(w, exponent_nibble, 4);
        for (int r = 0; r < R; ++r) {
          const uint16_t* xg = x + r * k + g * kGroup;
          int32_t pair_lo, pair_hi;
          std::memcpy(&pair_lo, xg + 2 * q, 4);
          std::memcpy(&pair_hi, xg + 16 + 2 * q, 4);
          __m512& chain_lo = dot[r][(2 * q) % kChains];
          __m512& chain_hi = dot[r][(2 * q + 1) % kChains];
          chain_lo = _mm512_dpbf16_ps(chain_lo, lo, (__m512bh)_mm512_set1_epi32(pair_lo));
          chain_hi = _mm512_dpbf16_ps(chain_hi, hi, (__m512bh)_mm512_set1_epi32(pair_hi));
        }
      }
    }
    // bfloat16 to float32: the 16 bits on top of a zero low half.
    const __m512i both = _mm512_loadu_si512(smb + sg * 2 * kBlock);
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(both)), 16));
    const __m512 minimum = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1)), 16));
    const __m512 scale64 = _mm512_mul_ps(scale, _mm512_set1_ps(64.f));  // exact
    const __m512 offset = _mm512_fnmadd_ps(scale, _mm512_set1_ps(128.f), minimum);
    for (int r = 0; r < R; ++r) {
      __m512 d = dot[r][0];
      for (int c = 1; c < kChains; ++c) d = _mm512_add_ps(d, dot[r][c]);
      total[r] = _mm512_fmadd_ps(d, scale64, total[r]);
      total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * scale_groups + sg]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, total[r]);
}

}  // namespace
#endif

// x: bfloat16 [m, k]; packed, scales_minima: int4_bf16_pack's; returns bfloat16 [m, n].
at::Tensor int4_bf16_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima) {
  TORCH_CHECK(CBGEN_INT4_BF16, "int4_bf16_matmul: built without AVX512-BF16 and VBMI2");
  [[maybe_unused]] const int64_t group =
      check_4bit_inputs("int4_bf16_matmul", x, packed, {8, 32}, scales_minima);
  auto out = at::empty({x.size(0), packed.size(0) * kBlock}, x.options());
#if CBGEN_INT4_BF16
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  const int64_t scale_groups = scales_minima.size(1), per = group / kGroup;
  auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> sums(m * scale_groups);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      group_sums(xp + row * k, k, group, sums.data() + row * scale_groups);
    }
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sm = reinterpret_cast<const uint16_t*>(scales_minima.data_ptr<at::BFloat16>());
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  for_each_block<4>(m, blocks, groups, scale_groups, w, sm, y,
                    [&](const uint8_t* wb, const uint16_t* smb, int64_t row, int64_t rows,
                        float* acc) {
                      const uint16_t* xr = xp + row * k;
                      const float* sr = sums.data() + row * scale_groups;
                      switch (rows) {
                        case 1: int4_bf16_block<1>(wb, smb, scale_groups, per, xr, k, sr, acc); break;
                        case 2: int4_bf16_block<2>(wb, smb, scale_groups, per, xr, k, sr, acc); break;
                        case 3: int4_bf16_block<3>(wb, smb, scale_groups, per, xr, k, sr, acc); break;
                        default: int4_bf16_block<4>(wb, smb, scale_groups, per, xr, k, sr, acc); break;
                      }
                    });
#endif
  return out;
}

// 4-bit weights times bfloat16 activations on AVX2 with FMA (AMD Zen 2 and 3, Intel
// client cores), no AVX-512: int4_bf16_pack's layout, int16 activations.
//
// torch's 4-bit kernel read SmolLM2's weights at ~8 GB/s there, a quarter of what the
// machine streams. AVX2 has no bfloat16 products, so each row's activations are
// rounded to int16 per scale group (a step of the group's largest magnitude over 32767,
// about 2^-15 of it, where bfloat16 itself rounds each value to 2^-9 of its own
// magnitude, as int8_rows_matmul does), and `vpmaddwd` multiplies 16 codes by 16 int16
// activations and adds adjacent pairs into exact int32 sums. In int4_bf16_pack's layout
// one 16-byte half of a pair's 32 bytes is 8 rows x 2 adjacent k, so zero-extending it
// to words puts row r's two codes in 32-bit lane r, against a 32-bit broadcast of the
// two activations, with no shuffles:
//
//   y[m, n] = sum_g scale[n, g] * step[m, g] * sum_k code[n, k] * xq[m, k]
//           + minimum[n, g] * S[m, g]
//
// with S the exact float32 sum of the group's activations.
#if !CBGEN_INT4_BF16 && defined(__AVX2__) && defined(__FMA__)
#define CBGEN_INT4_AVX2 1
#else
#define CBGEN_INT4_AVX2 0
#endif

bool int4_avx2_available() { return CBGEN_INT4_AVX2 != 0; }

namespace {

#if CBGEN_INT4_AVX2
// One row of bfloat16 activations as int16 per group of `group` columns and each
// group's step (its largest magnitude over 32767; a group of zeros or denormals gets
// no codes).
void quantize_row16(const uint16_t* x, int64_t k, int64_t group, int16_t* xq, float* steps) {
  for (int64_t g = 0; g < k / group; ++g) {
    float amax = 0.f;
    for (int64_t i = 0; i < group; ++i)
      amax = std::max(amax, std::fabs(c10::detail::f32_from_bits(x[g * group + i])));
    const float step = amax / 32767.f;
    const float inv = step >= FLT_MIN ? 1.f / step : 0.f;
    for (int64_t i = 0; i < group; ++i) {
      xq[g * group + i] = static_cast<int16_t>(
          std::nearbyint(c10::detail::f32_from_bits(x[g * group + i]) * inv));
    }
    steps[g] = step;
  }
}

// R rows of int16 activations (xq, row stride k; steps and sums, row stride
// scale_groups) against one block of 16 output rows (two halves of 8); out gets R x 16
// float32. At most 256 products of 15 * 32767 add up in a lane per scale group: exact.
template <int R>
void int4_avx2_block(const uint8_t* wb, const uint16_t* smb, int64_t scale_groups, int64_t per,
                     const int16_t* xq, int64_t k, const float* steps, const float* sums,
                     float* out) {
  // One row keeps the low and high nibbles' sums apart (4 chains of adds, not 2); two
  // or more rows are chains enough. Four rows a tile (the caller's) share each unpacked
  // code among four multiplies, so the multiplies alone set the pace: 30% more products
  // a second than two rows on a Zen 3 core at 64 rows, though the totals spill.
  constexpr int kChains = R == 1 ? 2 : 1;
  const __m256i low = _mm256_set1_epi16(15);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t sg = 0; sg < scale_groups; ++sg) {
    __m256i dot[R][2][kChains];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < kChains; ++c) dot[r][h][c] = _mm256_setzero_si256();
    for (int64_t g = sg * per; g < (sg + 1) * per; ++g) {
      const uint8_t* wg = wb + g * 256;
      for (int q = 0; q < 8; ++q) {
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + q * 32 + h * 16)));
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_srli_epi16(v, 4);
          for (int r = 0; r < R; ++r) {
            const int16_t* xg = xq + r * k + g * kGroup;
            int32_t pair_lo, pair_hi;
            std::memcpy(&pair_lo, xg + 2 * q, 4);
            std::memcpy(&pair_hi, xg + 16 + 2 * q, 4);
            __m256i& sum_lo = dot[r][h][0];
            __m256i& sum_hi = dot[r][h][kChains - 1];
            sum_lo = _mm256_add_epi32(sum_lo, _mm256_madd_epi16(lo, _mm256_set1_epi32(pair_lo)));
            sum_hi = _mm256_add_epi32(sum_hi, _mm256_madd_epi16(hi, _mm256_set1_epi32(pair_hi)));
          }
        }
      }
    }
    const uint16_t* smg = smb + sg * 2 * kBlock;
    for (int h = 0; h < 2; ++h) {
      const __m256 scale =
          bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(smg + 8 * h)));
      const __m256 minimum =
          bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(smg + kBlock + 8 * h)));
      for (int r = 0; r < R; ++r) {
        __m256i sum = dot[r][h][0];
        if (kChains == 2) sum = _mm256_add_epi32(sum, dot[r][h][kChains - 1]);
        total[r][h] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(sum),
            _mm256_mul_ps(scale, _mm256_set1_ps(steps[r * scale_groups + sg])), total[r][h]);
        total[r][h] =
            _mm256_fmadd_ps(minimum, _mm256_set1_ps(sums[r * scale_groups + sg]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kBlock, total[r][0]);
    _mm256_storeu_ps(out + r * kBlock + 8, total[r][1]);
  }
}
#endif

}  // namespace

at::Tensor int4_avx2_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const std::vector<at::Tensor>& packed,
                             const std::vector<at::Tensor>& scales_minima);

// x: bfloat16 [m, k]; packed, scales_minima: int4_bf16_pack's; returns bfloat16 [m, n].
at::Tensor int4_avx2_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima) {
  return int4_avx2_grouped(x, {x.size(0)}, {packed}, {scales_minima});
}

// Consecutive spans of x's rows (counts[i] rows each), span i against its own weights
// (packed[i], scales_minima[i]; all of one shape): an MoE layer's experts, each through
// its tokens, in one call instead of one a span from Python. Each row is rounded to
// int16 once, as int4_avx2_matmul rounds it, so every span's rows get the bits that
// call would give them. Returns bfloat16 [m, n].
at::Tensor int4_avx2_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const std::vector<at::Tensor>& packed,
                             const std::vector<at::Tensor>& scales_minima) {
  TORCH_CHECK(CBGEN_INT4_AVX2, "int4_avx2_matmul: built without AVX2 and FMA, or with AVX-512 "
              "(int4_bf16_matmul serves there)");
  check_spans("int4_avx2_grouped", x, counts, packed, scales_minima);
  const int64_t group =
      check_4bit_inputs("int4_avx2_matmul", x, packed[0], {8, 32}, scales_minima[0]);
  for (size_t i = 1; i < packed.size(); ++i)  // dtypes and layouts, each span's own
    check_4bit_inputs("int4_avx2_matmul", x, packed[i], {8, 32}, scales_minima[i]);
  auto out = at::empty({x.size(0), packed[0].size(0) * kBlock}, x.options());
#if CBGEN_INT4_AVX2
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = packed[0].size(0), groups = packed[0].size(1);
  const int64_t scale_groups = scales_minima[0].size(1), per = group / kGroup;
  const int64_t n = blocks * kBlock;
  auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<int16_t> xq(m * k);
  std::vector<float> steps(m * scale_groups), sums(m * scale_groups);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      quantize_row16(xp + row * k, k, group, xq.data() + row * k,
                     steps.data() + row * scale_groups);
      group_sums(xp + row * k, k, group, sums.data() + row * scale_groups);
    }
  });
  // Every (span, block) pair in one parallel loop: a decode token's 8 experts were 8
  // parallel regions a map, each one row against a sixteenth of the work a thread
  // could take at once.
  const std::vector<Span> spans = nonempty_spans(counts, packed, scales_minima);
  at::BFloat16* y_all = out.data_ptr<at::BFloat16>();
  const int64_t work = static_cast<int64_t>(spans.size()) * blocks;
  at::parallel_for(0, work, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Span& span = spans[item / blocks];
      const int64_t b = item % blocks, start = span.start;
      at::BFloat16* y = y_all + start * n;
      const int16_t* xs = xq.data() + start * k;
      const float* ss = steps.data() + start * scale_groups;
      const float* us = sums.data() + start * scale_groups;
      auto tile = [&](const uint8_t* wb, const uint16_t* smb, int64_t row, int64_t rows,
                      float* acc) {
        const int16_t* xr = xs + row * k;
        const float* st = ss + row * scale_groups;
        const float* su = us + row * scale_groups;
        switch (rows) {
          case 1: int4_avx2_block<1>(wb, smb, scale_groups, per, xr, k, st, su, acc); break;
          case 2: int4_avx2_block<2>(wb, smb, scale_groups, per, xr, k, st, su, acc); break;
          case 3: int4_avx2_block<3>(wb, smb, scale_groups, per, xr, k, st, su, acc); break;
          default: int4_avx2_block<4>(wb, smb, scale_groups, per, xr, k, st, su, acc); break;
        }
      };
      one_block<4>(span.rows, b, blocks, groups, scale_groups, span.w, span.sm, y, tile);
    }
  });
#endif
  return out;
}

// Spans of x's rows against their own 4-bit weights in one call, on the kernel of
// ``path`` (Int4Map.path): int4 on AVX2 and w4a8 round or quantize every row once and
// run every span's blocks in one parallel loop (int4_avx2_grouped, int4_vnni_grouped);
// AVX512-BF16's int4 runs a call a span from here. Either spares the caller's Python a
// call a span (an MoE layer's experts: one call for all its hit experts' maps).
at::Tensor int4_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                        const std::vector<at::Tensor>& packed,
                        const std::vector<at::Tensor>& scales_minima, const std::string& path) {
  if (path == "avx2") return int4_avx2_grouped(x, counts, packed, scales_minima);
  if (path == "vnni") return int4_vnni_grouped(x, counts, packed, scales_minima);
  at::Tensor (*matmul)(const at::Tensor&, const at::Tensor&, const at::Tensor&) = nullptr;
  if (path == "bf16") matmul = &int4_bf16_matmul;
  TORCH_CHECK(matmul != nullptr, "int4_grouped: no kernel path ", path);
  check_spans("int4_grouped", x, counts, packed, scales_minima);
  auto out = at::empty({x.size(0), packed[0].size(0) * kBlock}, x.options());
  int64_t start = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    if (counts[i] > 0) {
      out.narrow(0, start, counts[i])
          .copy_(matmul(x.narrow(0, start, counts[i]), packed[i], scales_minima[i]));
    }
    start += counts[i];
  }
  return out;
}
