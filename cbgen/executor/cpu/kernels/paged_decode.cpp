// Paged decode attention for CPU: one query token per sequence, read straight
// from the block tables.
//
// The threads share out the (sequence, query head) pairs; the heads of a thread's
// share that read one KV head are scored together, so each K and V row is read from
// memory once per layer for all of them (GQA-aware), with no gathered copy and no
// padding. Softmax is exact two-pass float32: scores, then max/exp/sum, then the
// weighted sum of V divided by the sum, which matches the torch path
// (CBGEN_NO_KERNELS=1) to float32 rounding.
//
// Where the compiler targets AVX-512 or AVX2+FMA (the build uses -march=native
// on x86-64), float32 and bfloat16 caches take SIMD paths: K rows are scored
// kWidth at a time with per-row accumulators in registers and one transposing
// add tree for their horizontal sums (a reduction per row cost more than the
// dot product itself), V rows are loaded once for all the query heads of a KV
// head into accumulators that stay in registers (value_pass: 41 -> 37 ms for a
// 64-sequence, 30-layer step at 150-300 tokens of context), and exp is
// vectorised. Compute is then about 3x the old scalar loop's speed, and at a few
// hundred tokens the kernel is bound by reading the cache from memory: the
// allocator keeps each request's blocks in a row for that reason
// (cbgen/cache/allocator.py), and the hardware prefetcher follows those runs.
// Software prefetching (the next block's keys, each block's values during the key
// pass) measured slower: 44 against 37 ms for that step with each request's
// blocks in a row, the same with every block scattered (bench: a 30-layer step
// whose K/V, 0.9 GB, cannot stay in cache). Other dtypes, head sizes that are not
// a multiple of the SIMD width, and builds without those instruction sets use
// plain loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// ---- row access: the cache's dtype, read as float32 -----------------------------

// Copy (and widen) n elements to float32; used for query rows and for caches in
// dtypes without a SIMD load (float16, float64).
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dot(q, k) over dim elements; q is float32, k in the cache's dtype.
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  float sum = 0.f;
  for (int64_t d = 0; d < dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// acc += p * v over dim elements.
template <typename scalar_t>
inline void axpy(float p, const scalar_t* v, float* acc, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <typename T>
inline vfloat vload_as_float(const T* p);
template <>
inline vfloat vload_as_float<float>(const float* p) { return vload(p); }
template <>
inline vfloat vload_as_float<c10::BFloat16>(const c10::BFloat16* p) { return vload_bf16(p); }

template <typename T>
constexpr bool kHasSimdLoad = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

template <typename T>
inline float dot_simd(const float* q, const T* k, int64_t dim) {
  vfloat a = vzero(), b = vzero();
  int64_t d = 0;
  for (; d + 2 * kWidth <= dim; d += 2 * kWidth) {
    a = vfma(vload(q + d), vload_as_float(k + d), a);
    b = vfma(vload(q + d + kWidth), vload_as_float(k + d + kWidth), b);
  }
  for (; d + kWidth <= dim; d += kWidth) a = vfma(vload(q + d), vload_as_float(k + d), a);
  float sum = vsum(vadd(a, b));
  for (; d < dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename T>
inline void axpy_simd(float p, const T* v, float* acc, int64_t dim) {
  const vfloat pv = vset1(p);
  int64_t d = 0;
  for (; d + kWidth <= dim; d += kWidth) vstore(acc + d, vfma(pv, vload_as_float(v + d), vload(acc + d)));
  for (; d < dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

template <>
inline float dot<float>(const float* q, const float* k, int64_t dim) { return dot_simd(q, k, dim); }
template <>
inline float dot<c10::BFloat16>(const float* q, const c10::BFloat16* k, int64_t dim) {
  return dot_simd(q, k, dim);
}
template <>
inline void axpy<float>(float p, const float* v, float* acc, int64_t dim) { axpy_simd(p, v, acc, dim); }
template <>
inline void axpy<c10::BFloat16>(float p, const c10::BFloat16* v, float* acc, int64_t dim) {
  axpy_simd(p, v, acc, dim);
}
#endif

// Softmax numerators in place: row[i] = exp(row[i] - max); returns their sum. A finite
// `sink` (an attention sink, GPT-OSS) is one more logit with no value: it joins the max
// and the sum, so it takes its share of the weight.
inline float exp_and_sum(float* row, int64_t n,
                         float sink = -std::numeric_limits<float>::infinity()) {
  float max_score = sink;
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (n >= kWidth) {
    vfloat m = vload(row);
    for (i = kWidth; i + kWidth <= n; i += kWidth) m = vmax(m, vload(row + i));
    max_score = std::max(max_score, vhmax(m));
  } else {
    i = 0;
  }
  for (; i < n; ++i) max_score = std::max(max_score, row[i]);
  const vfloat mv = vset1(max_score);
  vfloat total_v = vzero();
  for (i = 0; i + kWidth <= n; i += kWidth) {
    vfloat e = vexp(vsub(vload(row + i), mv));
    vstore(row + i, e);
    total_v = vadd(total_v, e);
  }
  float total = vsum(total_v);
#else
  for (; i < n; ++i) max_score = std::max(max_score, row[i]);
  float total = 0.f;
  i = 0;
#endif
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - max_score);
    total += row[i];
  }
  if (sink > -std::numeric_limits<float>::infinity()) total += std::exp(sink - max_score);
  return total;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Horizontal sums of kWidth vectors at once: lane i of the result is the sum of
// the lanes of the vector stored at slot(i). A transposing add tree costs about
// three instructions per vector, against eight or more for a reduction each.
constexpr int64_t tree_slot(int64_t i) {
  return kWidth == 16 ? i / 4 + 4 * (i % 4) : i / 4 + 2 * (i % 4);
}

inline vfloat sum_lanes(vfloat* a) {
#if defined(__AVX512F__)
  vfloat b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j) {
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  }
  for (int j = 0; j < 2; ++j) {
    d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
#else
  vfloat b[4], c[2];
  for (int j = 0; j < 4; ++j) {
    b[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));
  }
  for (int j = 0; j < 2; ++j) {
    c[j] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * j], b[2 * j + 1], 0x44),
                         _mm256_shuffle_ps(b[2 * j], b[2 * j + 1], 0xEE));
  }
  return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
#endif
}

// out[t] = scale * (sum of the lanes of the vector in acc[tree_slot(t)]) for t < n.
inline void store_scores(vfloat* acc, int64_t n, float scale, float* out) {
  vfloat s = vmul(sum_lanes(acc), vset1(scale));
  if (n == kWidth) {
    vstore(out, s);
  } else {
    float tmp[kWidth];
    vstore(tmp, s);
    for (int64_t t = 0; t < n; ++t) out[t] = tmp[t];
  }
}

// Scores of up to kWidth consecutive cached rows against one query head:
// out[t] = scale * q . k_t for t < n. The loop always runs kWidth rows (rows past
// n re-read row 0 and are not stored) so that it unrolls and the per-row
// accumulators stay in registers. DC = head_dim / kWidth when known, 0 otherwise.
template <typename T, int DC>
inline void score_rows(const float* q, const T* k, int64_t n, int64_t head_dim, float scale,
                       float* out) {
  vfloat acc[kWidth];
  const int64_t chunks = DC > 0 ? DC : head_dim / kWidth;
#pragma GCC unroll 16
  for (int64_t t = 0; t < kWidth; ++t) {
    const T* row = k + (t < n ? t : 0) * head_dim;
    vfloat a = vzero(), b = vzero();
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
      a = vfma(vload(q + c * kWidth), vload_as_float(row + c * kWidth), a);
      b = vfma(vload(q + (c + 1) * kWidth), vload_as_float(row + (c + 1) * kWidth), b);
    }
    if (c < chunks) a = vfma(vload(q + c * kWidth), vload_as_float(row + c * kWidth), a);
    acc[tree_slot(t)] = vadd(a, b);
  }
  store_scores(acc, n, scale, out);
}

// acc[d] += sum_t p[t] * v_t[d] over n rows, one kWidth slice of acc at a time so
// that the running sum stays in a register.
template <typename T>
inline void accumulate_rows(const float* p, const T* v, int64_t n, int64_t value_dim, float* acc) {
  for (int64_t c = 0; c < value_dim; c += kWidth) {
    vfloat a = vload(acc + c);
    for (int64_t t = 0; t < n; ++t) a = vfma(vset1(p[t]), vload_as_float(v + t * value_dim + c), a);
    vstore(acc + c, a);
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Pass 2 for G query heads of one item at once: acc[g] += sum_i p[g][i] * v_(first+i),
// with all G x DC accumulators in registers for the whole context and each V row
// loaded once for the G heads. Each element still sums over i in order, as the
// one-head loop does, so the result is the same to the bit.
template <typename T, int G, int DC>
void value_pass(const float* scores, int64_t span, const T* v_head, const int64_t* table,
                int64_t first, int64_t len, int64_t block_size, float* acc) {
  constexpr int64_t value_dim = DC * kWidth;
  const int64_t v_block_stride = block_size * value_dim;
  vfloat a[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = vload(acc + g * value_dim + c * kWidth);
  for (int64_t t = first; t < len;) {
    const int64_t block = t / block_size;
    const int64_t stop = std::min(len, (block + 1) * block_size);
    const T* v = v_head + table[block] * v_block_stride + (t - block * block_size) * value_dim;
    const float* p = scores + (t - first);
    for (int64_t r = 0; r < stop - t; ++r) {
      vfloat row[DC];
      for (int c = 0; c < DC; ++c) row[c] = vload_as_float(v + r * value_dim + c * kWidth);
      for (int g = 0; g < G; ++g) {
        const vfloat pv = vset1(p[g * span + r]);
        for (int c = 0; c < DC; ++c) a[g][c] = vfma(pv, row[c], a[g][c]);
      }
    }
    t = stop;
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) vstore(acc + g * value_dim + c * kWidth, a[g][c]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CBGEN_BF16_ATTEND 1
// ---- bfloat16 caches with AVX512-BF16 -------------------------------------------
// The float path above widens every K and V element to float32 before its FMA, and
// scores each K row once per query head: at SmolLM2's geometry (3 heads a KV head,
// head_dim 64) that is ~9,500 vector instructions an item at 110 tokens, and a
// 64-sequence step spent 11 ms in attention, compute-bound (one thread took 1.8x two
// threads' time). Here the query (already bfloat16) meets each K row through
// `vdpbf16ps`: 32 products a instruction, each exact in float32, with no widening.
// The V rows are widened two elements to a 32-bit lane at once (the even element is
// the lane shifted left by 16, the odd one the lane with its low half cleared), so the
// running sums hold even and odd columns apart until the end. Probabilities and sums
// stay float32, as in the float path; only the order of the float32 additions differs.

// Scores of up to 16 consecutive cached rows (head_dim = 32 * DC2) against one query
// head, q given as DC2 vectors of 32 bfloat16: out[t] = scale * q . k_t for t < n.
template <int DC2>
inline void score_rows_bf16(const __m512bh* q, const c10::BFloat16* k, int64_t n, float scale,
                            float* out) {
  vfloat acc[kWidth];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kWidth; ++t) {
    const c10::BFloat16* row = k + (t < n ? t : 0) * (DC2 * 32);
    __m512 a = _mm512_dpbf16_ps(vzero(), q[0], (__m512bh)_mm512_loadu_si512(row));
    for (int c = 1; c < DC2; ++c)
      a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
    acc[tree_slot(t)] = a;
  }
  store_scores(acc, n, scale, out);
}

// acc[g] += sum_i p[g][i] * v_(first+i) for G heads, each head's sums as 2 * DC2
// vectors: [2c] the even columns of 32-column chunk c, [2c + 1] the odd ones.
template <int G, int DC2>
void value_pass_bf16(const float* scores, int64_t span, const c10::BFloat16* v_head,
                     const int64_t* table, int64_t first, int64_t len, int64_t block_size,
                     float* acc) {
  constexpr int64_t value_dim = DC2 * 32;
  const int64_t v_block_stride = block_size * value_dim;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  vfloat a[G][2 * DC2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * DC2; ++c) a[g][c] = vload(acc + g * value_dim + c * kWidth);
  for (int64_t t = first; t < len;) {
    const int64_t block = t / block_size;
    const int64_t stop = std::min(len, (block + 1) * block_size);
    const c10::BFloat16* v =
        v_head + table[block] * v_block_stride + (t - block * block_size) * value_dim;
    const float* p = scores + (t - first);
    for (int64_t r = 0; r < stop - t; ++r) {
      vfloat row[2 * DC2];
      for (int c = 0; c < DC2; ++c) {
        const __m512i raw = _mm512_loadu_si512(v + r * value_dim + c * 32);
        row[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        row[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
      }
      for (int g = 0; g < G; ++g) {
        const vfloat pv = vset1(p[g * span + r]);
        for (int c = 0; c < 2 * DC2; ++c) a[g][c] = vfma(pv, row[c], a[g][c]);
      }
    }
    t = stop;
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * DC2; ++c) vstore(acc + g * value_dim + c * kWidth, a[g][c]);
}

// One (sequence, KV head) item on a bfloat16 cache, head_dim = value_dim = 32 * DC2:
// the `group` query heads at q (bfloat16) attend over cached positions [first, len).
template <int DC2>
void attend_bf16(const c10::BFloat16* q, int64_t group, const c10::BFloat16* k_head,
                 const c10::BFloat16* v_head, const int64_t* table, int64_t first, int64_t len,
                 int64_t block_size, float scale, float cap, const float* sinks,
                 std::vector<float>& scores, std::vector<float>& acc, c10::BFloat16* dst) {
  constexpr int64_t dim = DC2 * 32;
  const int64_t span = len - first;
  const int64_t block_stride = block_size * dim;
  scores.resize(group * span);
  std::fill(acc.begin(), acc.begin() + group * dim, 0.f);

  // Pass 1: scores[g][i] = scale * q_g . k_(first+i), block by block.
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[DC2];
    for (int c = 0; c < DC2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * dim + c * 32);
    float* out = scores.data() + g * span;
    for (int64_t t = first; t < len;) {
      const int64_t block = t / block_size;
      const int64_t stop = std::min(len, (block + 1) * block_size);
      const c10::BFloat16* k = k_head + table[block] * block_stride + (t - block * block_size) * dim;
      for (int64_t r = 0; r < stop - t; r += kWidth) {
        score_rows_bf16<DC2>(qv, k + r * dim, std::min<int64_t>(kWidth, stop - t - r), scale,
                             out + (t - first) + r);
      }
      t = stop;
    }
  }
  if (cap > 0.f) {
    for (int64_t i = 0; i < group * span; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
  }
  float* invs = acc.data() + group * dim;  // acc has room for one more float a head
  for (int64_t g = 0; g < group; ++g) {
    invs[g] = sinks == nullptr ? 1.f / exp_and_sum(scores.data() + g * span, span)
                               : 1.f / exp_and_sum(scores.data() + g * span, span, sinks[g]);
  }

  // Pass 2, a few heads at a time so that their sums stay in registers (up to 16).
  constexpr int kChunk = std::max(1, std::min(4, 8 / DC2));
  for (int64_t g0 = 0; g0 < group; g0 += kChunk) {
    const int64_t count = std::min<int64_t>(kChunk, group - g0);
    auto pass = &value_pass_bf16<1, DC2>;
    if (count == 2) pass = &value_pass_bf16<std::min(2, kChunk), DC2>;
    if (count == 3) pass = &value_pass_bf16<std::min(3, kChunk), DC2>;
    if (count == 4) pass = &value_pass_bf16<std::min(4, kChunk), DC2>;
    pass(scores.data() + g0 * span, span, v_head, table, first, len, block_size,
         acc.data() + g0 * dim);
  }

  // Scale by 1/sum, put even and odd columns back in order (lane j of the output takes
  // even[j / 2] or, for odd j, odd[j / 2]: index 16 + j / 2), round to bfloat16.
  const __m512i lower =
      _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i upper =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t g = 0; g < group; ++g) {
    const vfloat s = vset1(invs[g]);
    for (int c = 0; c < DC2; ++c) {
      const vfloat even = vmul(vload(acc.data() + g * dim + 2 * c * kWidth), s);
      const vfloat odd = vmul(vload(acc.data() + g * dim + (2 * c + 1) * kWidth), s);
      c10::BFloat16* out = dst + g * dim + c * 32;
      vstore_bf16(out, _mm512_permutex2var_ps(even, lower, odd));
      vstore_bf16(out + 16, _mm512_permutex2var_ps(even, upper, odd));
    }
  }
}
#else
#define CBGEN_BF16_ATTEND 0
#endif

// One (sequence, KV head) item: the `group` query heads in q_f (float32) attend
// over cached positions [first, len) through the block table.
template <typename scalar_t, int DC>
void attend(const float* q_f, int64_t group, const scalar_t* k_head, const scalar_t* v_head,
            const int64_t* table, int64_t first, int64_t len, int64_t block_size,
            int64_t head_dim, int64_t value_dim, float scale, float cap, const float* sinks,
            std::vector<float>& scores, std::vector<float>& acc, scalar_t* dst) {
  const int64_t span = len - first;
  const int64_t k_block_stride = block_size * head_dim;
  const int64_t v_block_stride = block_size * value_dim;
  scores.resize(group * span);
  std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr bool simd = kHasSimdLoad<scalar_t>;
  const bool simd_k = simd && head_dim % kWidth == 0;
  const bool simd_v = simd && value_dim % kWidth == 0;
#else
  constexpr bool simd_k = false, simd_v = false;
#endif

  // Pass 1: scores[g][i] = scale * q_g . k_(first+i), block by block.
  for (int64_t t = first; t < len;) {
    const int64_t block = t / block_size;
    const int64_t stop = std::min(len, (block + 1) * block_size);
    const scalar_t* k = k_head + table[block] * k_block_stride + (t - block * block_size) * head_dim;
    const int64_t i0 = t - first;
    if (simd_k) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      if constexpr (kHasSimdLoad<scalar_t>) {
        for (int64_t r = 0; r < stop - t; r += kWidth) {
          const int64_t n = std::min<int64_t>(kWidth, stop - t - r);
          for (int64_t g = 0; g < group; ++g) {
            score_rows<scalar_t, DC>(q_f + g * head_dim, k + r * head_dim, n, head_dim, scale,
                                     scores.data() + g * span + i0 + r);
          }
        }
      }
#endif
    } else {
      for (int64_t r = 0; r < stop - t; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          scores[g * span + i0 + r] = dot(q_f + g * head_dim, k + r * head_dim, head_dim) * scale;
        }
      }
    }
    t = stop;
  }
  if (cap > 0.f) {
    for (auto& s : scores) s = std::tanh(s / cap) * cap;
  }
  // Softmax numerators; the 1/total normalisation is applied to the output.
  for (int64_t g = 0; g < group; ++g) {
    const float inv = sinks == nullptr ? 1.f / exp_and_sum(scores.data() + g * span, span)
                                       : 1.f / exp_and_sum(scores.data() + g * span, span, sinks[g]);
    acc[group * value_dim + g] = inv;  // kept past the accumulators
  }

  // Pass 2: acc[g] = sum_i p[g][i] * v_(first+i).
  bool values_done = false;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (kHasSimdLoad<scalar_t> && DC > 0) {
    if (value_dim == DC * kWidth) {
      constexpr int kChunk = std::max(1, std::min(4, 16 / DC));
      for (int64_t g0 = 0; g0 < group; g0 += kChunk) {
        const int64_t count = std::min<int64_t>(kChunk, group - g0);
        auto pass = &value_pass<scalar_t, 1, DC>;
        if (count == 2) pass = &value_pass<scalar_t, std::min(2, kChunk), DC>;
        if (count == 3) pass = &value_pass<scalar_t, std::min(3, kChunk), DC>;
        if (count == 4) pass = &value_pass<scalar_t, std::min(4, kChunk), DC>;
        pass(scores.data() + g0 * span, span, v_head, table, first, len, block_size,
             acc.data() + g0 * value_dim);
      }
      values_done = true;
    }
  }
#endif
  for (int64_t t = first; t < len && !values_done;) {
    const int64_t block = t / block_size;
    const int64_t stop = std::min(len, (block + 1) * block_size);
    const scalar_t* v = v_head + table[block] * v_block_stride + (t - block * block_size) * value_dim;
    const int64_t i0 = t - first;
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores.data() + g * span + i0;
      float* a = acc.data() + g * value_dim;
      if (simd_v) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        if constexpr (kHasSimdLoad<scalar_t>) accumulate_rows(p, v, stop - t, value_dim, a);
#endif
      } else {
        for (int64_t r = 0; r < stop - t; ++r) axpy(p[r], v + r * value_dim, a, value_dim);
      }
    }
    t = stop;
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = acc[group * value_dim + g];
    const float* a = acc.data() + g * value_dim;
    for (int64_t d = 0; d < value_dim; ++d) dst[g * value_dim + d] = static_cast<scalar_t>(a[d] * inv);
  }
}

// The first cached position a query at context length `len` sees (0 without a window).
inline int64_t first_visible(int64_t len, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
}

template <typename scalar_t>
void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
            double scale, int64_t sliding_window, double softcap, const float* sinks) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0);
  const int64_t num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t value_dim = value_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);
  const int64_t k_head_stride = num_blocks * block_size * head_dim;
  const int64_t v_head_stride = num_blocks * block_size * value_dim;
  auto run = &attend<scalar_t, 0>;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (head_dim == 2 * kWidth) run = &attend<scalar_t, 2>;
  if (head_dim == 4 * kWidth) run = &attend<scalar_t, 4>;
  if (head_dim == 8 * kWidth) run = &attend<scalar_t, 8>;
#endif

#if CBGEN_BF16_ATTEND
  // bfloat16 caches whose rows are whole 64-byte vectors take the AVX512-BF16 path.
  auto run_bf16 = static_cast<decltype(&attend_bf16<2>)>(nullptr);
  if (std::is_same_v<scalar_t, c10::BFloat16> && value_dim == head_dim) {
    if (head_dim == 32) run_bf16 = &attend_bf16<1>;
    if (head_dim == 64) run_bf16 = &attend_bf16<2>;
    if (head_dim == 128) run_bf16 = &attend_bf16<4>;
  }
#endif

  // The work is split by query head: unit u is head u % num_heads of sequence
  // u / num_heads, and each thread takes a contiguous share of the units with an equal
  // share of their cost (context length plus a constant), not an equal count: with two
  // threads an even split by count left one idle for a tenth of the call on mixed
  // lengths. A thread runs the heads of its share that read one KV head as one call
  // (GQA-aware: each K and V row is read once for all of them). Splitting by KV head
  // alone left a single stream of SmolLM2 (3 KV heads) two heads on one thread and one
  // on the other, and a model with one KV head on one thread. A head's arithmetic does
  // not depend on the heads beside it in a call, so the output is the same bits however
  // the heads are shared out.
  const int64_t num_units = num_seqs * num_heads;
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_units));
  std::vector<int64_t> bounds(num_threads + 1, num_units);
  bounds[0] = 0;
  {
    auto cost = [&](int64_t seq) {
      const int64_t len = lens[seq];
      const int64_t first = first_visible(len, sliding_window);
      return std::max<int64_t>(0, len - first) + 16;
    };
    int64_t total = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) total += cost(seq) * num_heads;
    int64_t done = 0, next = 1;
    for (int64_t unit = 0; unit < num_units && next < num_threads; ++unit) {
      done += cost(unit / num_heads);
      while (next < num_threads && done * num_threads >= total * next) bounds[next++] = unit + 1;
    }
  }
  at::parallel_for(0, num_threads, 1, [&](int64_t first_share, int64_t last_share) {
    std::vector<float> q_f(group * head_dim);
    std::vector<float> scores;
    std::vector<float> acc(group * value_dim + group);
    for (int64_t unit = bounds[first_share]; unit < bounds[last_share];) {
      // The heads [head, head + count) of this share that read KV head `kv_head`.
      const int64_t seq = unit / num_heads;
      const int64_t head = unit % num_heads;
      const int64_t kv_head = head / group;
      const int64_t count =
          std::min((kv_head + 1) * group, head + bounds[last_share] - unit) - head;
      unit += count;
      const int64_t len = lens[seq];
      const int64_t first = first_visible(len, sliding_window);
      scalar_t* dst = out_ptr + (seq * num_heads + head) * value_dim;
      if (len - first <= 0) {  // nothing to attend to: zeros, like an empty weighted sum
        std::fill(dst, dst + count * value_dim, static_cast<scalar_t>(0.f));
        continue;
      }
      const float* head_sinks = sinks == nullptr ? nullptr : sinks + head;
#if CBGEN_BF16_ATTEND
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (run_bf16 != nullptr) {
          run_bf16(q_ptr + (seq * num_heads + head) * head_dim, count,
                   k_ptr + kv_head * k_head_stride, v_ptr + kv_head * v_head_stride,
                   tables + seq * table_width, first, len, block_size, fscale, fcap, head_sinks,
                   scores, acc, dst);
          continue;
        }
      }
#endif
      to_float(q_ptr + (seq * num_heads + head) * head_dim, q_f.data(), count * head_dim);
      run(q_f.data(), count, k_ptr + kv_head * k_head_stride, v_ptr + kv_head * v_head_stride,
          tables + seq * table_width, first, len, block_size, head_dim, value_dim, fscale, fcap,
          head_sinks, scores, acc, dst);
    }
  });
}

}  // namespace

// query [seqs, heads, dim]; caches [kv_heads, blocks, block_size, dim];
// block_tables [seqs, width] int64; context_lens [seqs] int64.
// sliding_window <= 0 means none; softcap <= 0 means none; sinks: float32 [heads] or none.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window, double softcap,
                                  const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                  context_lens.numel() == query.size(0),
              "one block table row and one context length per query");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  {
    // The kernel reads through the tables unchecked: make sure every block a
    // sequence reads is inside the cache first (a few hundred integers a call).
    const int64_t* table_ptr = tables.data_ptr<int64_t>();
    const int64_t* len_ptr = lens.data_ptr<int64_t>();
    const int64_t width = tables.size(1), block_size = key_cache.size(2);
    const int64_t num_blocks = key_cache.size(1);
    TORCH_CHECK(value_cache.size(1) == num_blocks && value_cache.size(2) == block_size,
                "key and value caches differ in blocks");
    for (int64_t seq = 0; seq < tables.size(0); ++seq) {
      const int64_t len = len_ptr[seq];
      TORCH_CHECK(len >= 0 && len <= width * block_size, "context length ", len,
                  " does not fit its block table");
      const int64_t first = first_visible(len, sliding_window);
      for (int64_t b = first / block_size; b * block_size < len; ++b) {
        const int64_t block = table_ptr[seq * width + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is outside the cache");
      }
    }
  }
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == query.size(1),
                "sinks must be a contiguous float32 tensor of one logit per head");
    sink_ptr = sinks->data_ptr<float>();
  }
  auto out = at::empty({query.size(0), query.size(1), value_cache.size(3)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(query, key_cache, value_cache, tables, lens, out, scale, sliding_window,
                     softcap, sink_ptr);
  });
  return out;
}
