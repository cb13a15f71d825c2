// 4-bit weights times int8 activations with AVX512-VNNI, for a few rows at a time.
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CBGEN_INT4_VNNI 1
#else
#define CBGEN_INT4_VNNI 0
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 16;

// One row of activations as int8 codes per group of 32, their scales and plain sums.
void quantize_row(const at::BFloat16* x, int64_t k, int8_t* xq, float* dx, float* sx) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    float values[kGroup];
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      values[i] = static_cast<float>(x[g * kGroup + i]);
      amax = std::max(amax, std::fabs(values[i]));
      sum += values[i];
    }
    // A group of zeros (or of denormals, whose inverse scale would overflow) gets no
    // codes; its exact sum still multiplies the minima.
    const float scale = amax / 127.f;
    const float inv = scale >= FLT_MIN ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      xq[g * kGroup + i] = static_cast<int8_t>(std::nearbyint(values[i] * inv));
    }
    dx[g] = scale;
    sx[g] = sum;
  }
}

}  // namespace

bool int4_vnni_available() { return CBGEN_INT4_VNNI != 0; }

// codes: uint8 [n, k] in 0..15; scales, minima: float32 [n, k / 32].
// Returns (packed uint8 [n / 16, k / 32, 4, 64], scales then minima bfloat16 [n / 16, k / 32, 32]).
std::vector<at::Tensor> int4_vnni_pack(const at::Tensor& codes, const at::Tensor& scales,
                                       const at::Tensor& minima) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes: uint8 [n, k]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % kGroup == 0, "int4_vnni_pack: n % 16 or k % 32 != 0");
  const int64_t groups = k / kGroup, blocks = n / kBlock;
  auto c = codes.contiguous();
  auto packed = at::empty({blocks, groups, 4, 64}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t p = 0; p < 4; ++p) {
          uint8_t* out = dst + ((b * groups + g) * 4 + p) * 64;
          for (int64_t r = 0; r < kBlock; ++r) {
            const uint8_t* row = src + (b * kBlock + r) * k + g * kGroup;
            for (int64_t i = 0; i < 4; ++i) {
              out[4 * r + i] = static_cast<uint8_t>((row[4 * p + i] & 15) |
                                                    ((row[16 + 4 * p + i] & 15) << 4));
            }
          }
        }
      }
    }
  });
  auto reblock = [&](const at::Tensor& t) {
    return t.to(at::kBFloat16).reshape({blocks, kBlock, groups}).transpose(1, 2);
  };
  return {packed, at::cat({reblock(scales), reblock(minima)}, 2).contiguous()};
}

// x: bfloat16 [m, k]; returns bfloat16 [m, n].
at::Tensor int4_vnni_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [m, k]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 4 && packed.size(3) == 64, "packed layout");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == k, "int4_vnni_matmul: k does not match the packed weights");
  TORCH_CHECK(scales_minima.scalar_type() == at::kBFloat16 && scales_minima.is_contiguous() &&
                  scales_minima.numel() == blocks * groups * 2 * kBlock,
              "int4_vnni_matmul: scales and minima must be bfloat16 [n / 16, k / 32, 32]");
  const int64_t n = blocks * kBlock;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * groups), sx(m * groups);
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  for (int64_t row = 0; row < m; ++row) {
    quantize_row(xp + row * k, k, xq.data() + row * k, dx.data() + row * groups,
                 sx.data() + row * groups);
  }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sm = reinterpret_cast<const uint16_t*>(scales_minima.data_ptr<at::BFloat16>());
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* wb = w + b * groups * 256;
      const uint16_t* smb = sm + b * groups * 2 * kBlock;
      for (int64_t row = 0; row < m; ++row) {
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
    }
  });
  return out;
}

// The same 4-bit weights times bfloat16 activations with AVX512-BF16 (the "int4" mode):
// no activation rounding, so it keeps int4's quality, and it reads the codes in the
// layout above.
//
// `vdpbf16ps` multiplies bfloat16 pairs, so each code has to become a bfloat16 first.
// Interleaving a code byte c (0..15) with the byte 0x43 makes the 16-bit word 0x4300 | c,
// which is the bfloat16 of 128 + c: one unpack turns 8 codes of a row into 8 exact
// bfloat16 values, with no conversion. The 128 comes back out per group with the
// activations' sum: sum_k x_k (128 + c_k) = sum_k x_k c_k + 128 sum_k x_k, so
//
//   y[m, n] = sum_g scale[n, g] * D[m, n, g] + (minimum[n, g] - 128 scale[n, g]) * S[m, g]
//
// with D the group's dot product of x against 128 + code and S the group's activation
// sum, both in float32. The unpack works within 128-bit lanes: from one 64-byte quad it
// gives two registers, "A" with rows 4j and 4j + 1 of the block and "B" with rows 4j + 2
// and 4j + 3 (j = 0..3), each row in two 32-bit lanes (codes 4p, 4p + 1 and 4p + 2,
// 4p + 3), so the activations for a quad are its 4 values repeated: one 64-bit broadcast.
// Per group the scales are spread to that lane order by one permute each; the two lanes
// of a row are added once, at the end.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CBGEN_INT4_BF16 1
#else
#define CBGEN_INT4_BF16 0
#endif

bool int4_bf16_available() { return CBGEN_INT4_BF16 != 0; }

#if CBGEN_INT4_BF16
namespace {

// 16-bit word indices into a group's 32 scale/minimum words (scales 0..15, minima 16..31)
// that put row (4j + t / 2) [A] or (4j + 2 + t / 2) [B] in the high half of 32-bit lane
// 4j + t; the low halves are masked to zero, so each lane is that row's float32 value.
struct LaneOrder {
  alignas(64) uint16_t scale_a[32], scale_b[32], minimum_a[32], minimum_b[32];
  LaneOrder() {
    for (int lane = 0; lane < 16; ++lane) {
      const int j = lane / 4, t = lane % 4;
      for (int half = 0; half < 2; ++half) {
        scale_a[2 * lane + half] = static_cast<uint16_t>(4 * j + t / 2);
        scale_b[2 * lane + half] = static_cast<uint16_t>(4 * j + 2 + t / 2);
        minimum_a[2 * lane + half] = static_cast<uint16_t>(16 + 4 * j + t / 2);
        minimum_b[2 * lane + half] = static_cast<uint16_t>(16 + 4 * j + 2 + t / 2);
      }
    }
  }
};
const LaneOrder kLaneOrder;

// High words of every lane; high words of lanes 4j and 4j + 2 only (one lane per row, for
// the term added once per row).
constexpr __mmask32 kHighWords = 0xAAAAAAAAu;
constexpr __mmask32 kHighWordsOnePerRow = 0x22222222u;

// R rows of activations (x, row stride k; S their group sums, row stride groups) against
// one block of 16 output rows; out gets R x 16 float32.
template <int R>
void int4_bf16_block(const uint8_t* wb, const uint16_t* smb, int64_t groups, const uint16_t* x,
                     int64_t k, const float* sums, float* out) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i bias = _mm512_set1_epi8(0x43);
  const __m512i order_sa = _mm512_load_si512(kLaneOrder.scale_a);
  const __m512i order_sb = _mm512_load_si512(kLaneOrder.scale_b);
  const __m512i order_ma = _mm512_load_si512(kLaneOrder.minimum_a);
  const __m512i order_mb = _mm512_load_si512(kLaneOrder.minimum_b);
  // A few rows keep four chains of vdpbf16ps a row, so consecutive ones do not wait on
  // each other; more rows are chains enough with two, and the fewer registers leave room
  // for the rows' totals and one quad's codes without spilling.
  constexpr int kChains = R <= 2 ? 2 : 1;
  __m512 total_a[R], total_b[R];
  for (int r = 0; r < R; ++r) total_a[r] = total_b[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wb + g * 256;
    __m512 dot_a[R][kChains], dot_b[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kChains; ++c) dot_a[r][c] = dot_b[r][c] = _mm512_setzero_ps();
    }
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(wg + p * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512bh a_lo = (__m512bh)_mm512_unpacklo_epi8(lo, bias);
      const __m512bh b_lo = (__m512bh)_mm512_unpackhi_epi8(lo, bias);
      const __m512bh a_hi = (__m512bh)_mm512_unpacklo_epi8(hi, bias);
      const __m512bh b_hi = (__m512bh)_mm512_unpackhi_epi8(hi, bias);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xg = x + r * k + g * 32;
        int64_t quad_lo, quad_hi;
        std::memcpy(&quad_lo, xg + 4 * p, 8);
        std::memcpy(&quad_hi, xg + 16 + 4 * p, 8);
        const __m512bh x_lo = (__m512bh)_mm512_set1_epi64(quad_lo);
        const __m512bh x_hi = (__m512bh)_mm512_set1_epi64(quad_hi);
        dot_a[r][0] = _mm512_dpbf16_ps(dot_a[r][0], a_lo, x_lo);
        dot_b[r][0] = _mm512_dpbf16_ps(dot_b[r][0], b_lo, x_lo);
        dot_a[r][kChains - 1] = _mm512_dpbf16_ps(dot_a[r][kChains - 1], a_hi, x_hi);
        dot_b[r][kChains - 1] = _mm512_dpbf16_ps(dot_b[r][kChains - 1], b_hi, x_hi);
      }
    }
    const __m512i both = _mm512_loadu_si512(smb + g * 32);
    const __m512 scale_a =
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, order_sa, both));
    const __m512 scale_b =
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, order_sb, both));
    // minimum - 128 scale, in one lane per row.
    const __m512 offset_a = _mm512_fnmadd_ps(
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWordsOnePerRow, order_sa, both)),
        _mm512_set1_ps(128.f),
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWordsOnePerRow, order_ma, both)));
    const __m512 offset_b = _mm512_fnmadd_ps(
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWordsOnePerRow, order_sb, both)),
        _mm512_set1_ps(128.f),
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWordsOnePerRow, order_mb, both)));
    for (int r = 0; r < R; ++r) {
      __m512 da = dot_a[r][0], db = dot_b[r][0];
      if (kChains == 2) {
        da = _mm512_add_ps(da, dot_a[r][kChains - 1]);
        db = _mm512_add_ps(db, dot_b[r][kChains - 1]);
      }
      const __m512 sum = _mm512_set1_ps(sums[r * groups + g]);
      total_a[r] = _mm512_fmadd_ps(da, scale_a, total_a[r]);
      total_a[r] = _mm512_fmadd_ps(offset_a, sum, total_a[r]);
      total_b[r] = _mm512_fmadd_ps(db, scale_b, total_b[r]);
      total_b[r] = _mm512_fmadd_ps(offset_b, sum, total_b[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float a[16], b[16];
    _mm512_store_ps(a, total_a[r]);
    _mm512_store_ps(b, total_b[r]);
    for (int j = 0; j < 4; ++j) {
      out[r * 16 + 4 * j] = a[4 * j] + a[4 * j + 1];
      out[r * 16 + 4 * j + 1] = a[4 * j + 2] + a[4 * j + 3];
      out[r * 16 + 4 * j + 2] = b[4 * j] + b[4 * j + 1];
      out[r * 16 + 4 * j + 3] = b[4 * j + 2] + b[4 * j + 3];
    }
  }
}

}  // namespace
#endif

// x: bfloat16 [m, k]; packed, scales_minima: int4_vnni_pack's; returns bfloat16 [m, n].
at::Tensor int4_bf16_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_minima) {
  TORCH_CHECK(CBGEN_INT4_BF16, "int4_bf16_matmul: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [m, k]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 4 && packed.size(3) == 64 &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed layout");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == k, "int4_bf16_matmul: k does not match the packed weights");
  TORCH_CHECK(scales_minima.scalar_type() == at::kBFloat16 && scales_minima.is_contiguous() &&
                  scales_minima.numel() == blocks * groups * 2 * kBlock,
              "int4_bf16_matmul: scales and minima must be bfloat16 [n / 16, k / 32, 32]");
  const int64_t n = blocks * kBlock;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
#if CBGEN_INT4_BF16
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> sums(m * groups);
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) {
        s += c10::detail::f32_from_bits(xp[row * k + g * kGroup + i]);
      }
      sums[row * groups + g] = s;
    }
  }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sm = reinterpret_cast<const uint16_t*>(scales_minima.data_ptr<at::BFloat16>());
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    float acc[4 * kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* wb = w + b * groups * 256;
      const uint16_t* smb = sm + b * groups * 2 * kBlock;
      for (int64_t row = 0; row < m; row += 4) {
        const int64_t rows = std::min<int64_t>(4, m - row);
        const uint16_t* xr = xp + row * k;
        const float* sr = sums.data() + row * groups;
        switch (rows) {
          case 1: int4_bf16_block<1>(wb, smb, groups, xr, k, sr, acc); break;
          case 2: int4_bf16_block<2>(wb, smb, groups, xr, k, sr, acc); break;
          case 3: int4_bf16_block<3>(wb, smb, groups, xr, k, sr, acc); break;
          default: int4_bf16_block<4>(wb, smb, groups, xr, k, sr, acc); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          at::BFloat16* yr = y + (row + r) * n + b * kBlock;
          for (int64_t c = 0; c < kBlock; ++c) yr[c] = static_cast<at::BFloat16>(acc[r * kBlock + c]);
        }
      }
    }
  });
#endif
  return out;
}
