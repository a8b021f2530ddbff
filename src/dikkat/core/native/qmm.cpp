// Products of fp32 activations with weights packed in blocks of 4- or 8-bit unsigned integers.
//
// A weight row of K values is stored as K/B blocks (B = 32, or 16); value j of block b is
//   scale[b] * (q[j] - zero)        (symmetric formats: no offset tensor), or
//   scale[b] * q[j] + offset[b]     (formats with a per-block minimum),
// scales and offsets in fp32, or in fp16 (a file's own fp16 values, read a quarter fewer bytes).
// 8-bit q: one byte a value. 4-bit q: 16 bytes a block of 32, byte j holding value j in its low
// nibble and value j + 16 in its high nibble (ggml's Q4_0 order,
// https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
//
// Each activation row is rounded to int16 per block of 32, a[j] = round(x[j] / d) with
// d = max|x| / 32767 (16 bits, not llama.cpp's 8: an 8-bit rounding of a block that holds one of
// a model's outlier features moves a real model's logits by tenths, and flips greedy tokens);
// the product is then exactly
//   sum over blocks of  scale * d * sum_j (q[j] - zero) * a[j]   (integers, exact), or
//                       d * (scale * sum_j q[j] a[j] + offset * sum_j a[j]),
// i.e. the dequantised weight times the rounded activations, summed in fp32. The integer sums
// use AVX-512 VNNI (vpdpwssd: 16-bit times 16-bit, two products into a 32-bit lane) where the
// compiler targets it; elsewhere plain loops that the compiler vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define DIKKAT_VNNI 1
#else
#define DIKKAT_VNNI 0
#endif

namespace {

constexpr int64_t kGroup = 32;  // activation block
constexpr int64_t kTile = 4;     // activation rows multiplied with one unpacked weight block
constexpr int64_t kAhead = 4096;  // bytes of weight rows asked for ahead of their turn
constexpr int32_t kLevels = 32767;  // activations: round(x / d), d = max |x| / kLevels

// Scales and offsets are fp32, or fp16 where a file's fp16 values are kept as they are.
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }
#if DIKKAT_VNNI
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const at::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}
#endif

struct Rounded {
  std::vector<int16_t> q;    // (M, K)
  std::vector<float> d;      // (M, K / 32) block scales
  std::vector<int32_t> sum;  // (M, K / 16) sums of the rounded values, per 16
};

void round_rows(const float* x, int64_t M, int64_t K, Rounded& r) {
  const int64_t G = K / kGroup;
  r.q.resize(M * K);
  r.d.resize(M * G);
  r.sum.resize(M * G * 2);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* v = x + m * K + g * kGroup;
        int16_t* q = r.q.data() + m * K + g * kGroup;
#if DIKKAT_VNNI
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / static_cast<float>(kLevels);
        // x / d rounded half to even, as std::nearbyint below and torch.round do
        const __m512 dv = _mm512_set1_ps(d > 0.f ? d : 1.f);
        constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_div_ps(v0, dv), kNearest);
        __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_div_ps(v1, dv), kNearest);
        if (!(d > 0.f)) i0 = i1 = _mm512_setzero_si512();
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(i0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtsepi32_epi16(i1));
        r.d[m * G + g] = d;
        r.sum[(m * G + g) * 2] = _mm512_reduce_add_epi32(i0);
        r.sum[(m * G + g) * 2 + 1] = _mm512_reduce_add_epi32(i1);
#else
        float amax = 0.f;
        for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float d = amax / static_cast<float>(kLevels);
        int32_t s[2] = {0, 0};
        for (int j = 0; j < kGroup; ++j) {
          const int v8 = d > 0.f ? static_cast<int>(std::nearbyint(v[j] / d)) : 0;
          q[j] = static_cast<int16_t>(v8);
          s[j / 16] += v8;
        }
        r.d[m * G + g] = d;
        r.sum[(m * G + g) * 2] = s[0];
        r.sum[(m * G + g) * 2 + 1] = s[1];
#endif
      }
    }
  });
}

struct Prepared {  // per activation row, laid out for a weight's blocks of BLOCK values
  std::vector<float> d;   // (M, K / BLOCK + 4): the row's block scale, per weight block (padded)
  std::vector<float> da;  // (M, K / BLOCK): d times the sum of the rounded values of the block
};

template <int BLOCK>
void prepare(const Rounded& r, int64_t M, int64_t K, Prepared& p) {
  const int64_t G = K / kGroup, per_row = K / BLOCK, stride = per_row + 4;
  p.d.assign(M * stride, 0.f);
  p.da.resize(M * per_row);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < per_row; ++b) {
      const int64_t g = BLOCK == 32 ? b : b / 2;
      const float d = r.d[m * G + g];
      const int32_t* s = r.sum.data() + (m * G + g) * 2;
      const int32_t total = BLOCK == 32 ? s[0] + s[1] : s[b % 2];
      p.d[m * stride + b] = d;
      p.da[m * per_row + b] = d * static_cast<float>(total);
    }
  }
}


// the zero point's (or the offsets') part of a product: a dot product over the row's blocks,
// -zero * sum_b scale_b * da_b, or sum_b offset_b * da_b
template <bool OFFSET, typename S>
inline float block_part(const S* s, const S* o, const float* da, int64_t per_row, int32_t zero) {
  const S* w = OFFSET ? o : s;
  float e = 0.f;
#if DIKKAT_VNNI
  __m512 ev = _mm512_setzero_ps();
  for (int64_t b = 0; b < per_row; b += 16) {
    const __mmask16 k = per_row - b >= 16 ? 0xFFFF : (1u << (per_row - b)) - 1;
    ev = _mm512_fmadd_ps(load16(w + b, k), _mm512_maskz_loadu_ps(k, da + b), ev);
  }
  e = _mm512_reduce_add_ps(ev);
#else
  for (int64_t b = 0; b < per_row; ++b) e += to_float(w[b]) * da[b];
#endif
  return OFFSET ? e : -static_cast<float>(zero) * e;
}

#if DIKKAT_VNNI
// block_part's terms, unsummed: lanes the product's accumulator starts from (one reduction a row)
template <bool OFFSET, typename S>
inline __m512 block_part_lanes(const S* s, const S* o, const float* da, int64_t per_row,
                               int32_t zero) {
  const S* w = OFFSET ? o : s;
  __m512 ev = _mm512_setzero_ps();
  for (int64_t b = 0; b < per_row; b += 16) {
    const __mmask16 k = per_row - b >= 16 ? 0xFFFF : (1u << (per_row - b)) - 1;
    ev = _mm512_fmadd_ps(load16(w + b, k), _mm512_maskz_loadu_ps(k, da + b), ev);
  }
  return OFFSET ? ev : _mm512_mul_ps(ev, _mm512_set1_ps(-static_cast<float>(zero)));
}
#endif

#if DIKKAT_VNNI
// A step multiplies 64 values of a weight row (32 bytes of 4-bit, 64 of 8-bit integers) as two
// products of 32 16-bit words (vpdpwssd), W0 · A0 and W1 · A1, whose 16 int32 lanes each sum
// two neighbouring words. Which blocks the lanes of each product belong to, in its lanes 0-7
// and 8-15, relative to the step's first block (64 / BLOCK blocks a step):
//   4 bits, blocks of 32: W0 the low nibbles of the 32 bytes (values 0-15 of both blocks), W1
//     the high ones (values 16-31): both products (0 | 1), so they are summed as integers;
//   4 bits, blocks of 16: W0 (0 | 2), W1 (1 | 3);
//   8 bits, blocks of 32: W0 (0 | 0), W1 (1 | 1);
//   8 bits, blocks of 16: W0 (0 | 1), W1 (2 | 3).
// The activations of a 4-bit weight are laid out to match (nibble_order); a lone last block
// of 32 (K % 64 = 32) fills W0's and W1's lanes 0-7 alone, the rest being zero words.
template <int BITS, int BLOCK>
constexpr int kLanes[2][2] = {{0, 0}, {0, 0}};
template <> constexpr int kLanes<4, 32>[2][2] = {{0, 1}, {0, 1}};
template <> constexpr int kLanes<4, 16>[2][2] = {{0, 2}, {1, 3}};
template <> constexpr int kLanes<8, 32>[2][2] = {{0, 0}, {1, 1}};
template <> constexpr int kLanes<8, 16>[2][2] = {{0, 1}, {2, 3}};

// the weight words W0, W1 of step i (see kLanes)
template <int BITS>
inline void load_step(const uint8_t* row, int64_t i, bool half, __m512i& w0, __m512i& w1) {
  if constexpr (BITS == 4) {
    const uint8_t* p = row + i * 32;
    const __m256i bytes =  // 32 bytes, or a lone block's 16 and zeros
        half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i w = _mm512_cvtepu8_epi16(bytes);
    w0 = _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
    w1 = _mm512_srli_epi16(w, 4);
  } else {
    const uint8_t* p = row + i * 64;
    w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    w1 = half ? _mm512_setzero_si512()
              : _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  }
}

// 16 lanes holding sd[lo] in lanes 0-7 and sd[hi] in lanes 8-15
inline __m512 spread(const float* sd, int lo, int hi) {
  const __m512 a = _mm512_set1_ps(sd[lo]);
  return lo == hi ? a : _mm512_mask_blend_ps(0xFF00, a, _mm512_set1_ps(sd[hi]));
}

// activations of a 4-bit weight: per 64 values [0-15, 32-47, 16-31, 48-63], so that A0 holds
// values 0-15 of both blocks and A1 values 16-31 (a lone last block of 32 stays as it is)
void nibble_order(int16_t* q, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k + 64 <= K; k += 64) {
      int16_t* v = q + m * K + k;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + 16), b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + 32), a);
    }
  }
}
#endif

#if DIKKAT_VNNI
// ask for weight row n (its values, scales and offsets) ahead of its turn: the hardware
// prefetchers stop at page boundaries, and a layer's share of a thread is a few pages
template <bool OFFSET, typename S>
inline void prefetch_row(const uint8_t* values, const S* scale, const S* offset, int64_t n,
                         int64_t row_bytes, int64_t per_row) {
  const char* v = reinterpret_cast<const char*>(values + n * row_bytes);
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(v + b, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scale + n * per_row), _MM_HINT_T0);
  if constexpr (OFFSET) _mm_prefetch(reinterpret_cast<const char*>(offset + n * per_row), _MM_HINT_T0);
}
#endif

// out[m, n] for the TILE rows m from m0 and weight rows n in [n0, n1)
template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void multiply(const Rounded& r, const Prepared& p, int64_t K, int64_t N, const uint8_t* values,
              const S* scale, const S* offset, int32_t zero, int64_t m0, int64_t n0,
              int64_t n1, float* out) {
  const int64_t row_bytes = K * BITS / 8, per_row = K / BLOCK, stride = per_row + 4;
  const int16_t* aq[TILE];
  const float* ad[TILE];
  for (int t = 0; t < TILE; ++t) {
    aq[t] = r.q.data() + (m0 + t) * K;
    ad[t] = p.d.data() + (m0 + t) * stride;
  }
#if DIKKAT_VNNI
  const int64_t ahead = std::max<int64_t>(1, kAhead / row_bytes);
  for (int64_t n = n0; n < std::min(n0 + ahead, n1); ++n) {  // the first rows of the share
    prefetch_row<OFFSET>(values, scale, offset, n, row_bytes, per_row);
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = values + n * row_bytes;
    const S* s = scale + n * per_row;
    const S* o = OFFSET ? offset + n * per_row : nullptr;
#if DIKKAT_VNNI
    if (n + ahead < n1) prefetch_row<OFFSET>(values, scale, offset, n + ahead, row_bytes, per_row);
    // sd: a block's scale times the activation's block scale, for the 16 blocks from step i's
    // (see kLanes for which lanes take which); two accumulators a row, even and odd steps
    constexpr int64_t per_step = 64 / BLOCK, steps_per_load = 16 / per_step;
    constexpr auto& lanes = kLanes<BITS, BLOCK>;
    alignas(64) float sd[TILE][16];
    __m512 acc[TILE], acc2[TILE];
    // every loop over the tile's rows unrolled, so that acc and acc2 are registers: a loop
    // left rolled indexes them at run time, from the stack, a load and a store each step
    #pragma GCC unroll 8
    for (int t = 0; t < TILE; ++t) {
      acc[t] = _mm512_setzero_ps();
      acc2[t] = block_part_lanes<OFFSET>(s, o, p.da.data() + (m0 + t) * per_row, per_row, zero);
    }
    const int64_t steps = (K + 63) / 64;
    // inlined at both calls, so that the accumulators stay in registers (called, it takes
    // them by address: every step then loads and stores them)
    auto step = [&](int64_t i, __m512 (&into)[TILE]) __attribute__((always_inline)) {
      const int64_t j = (i % steps_per_load) * per_step;  // the step's first block in sd
      if (j == 0) {
        const int64_t b = i * per_step, left = per_row - b;
        const __mmask16 k = left >= 16 ? 0xFFFF : (1u << left) - 1;
        const __m512 sv = load16(s + b, k);
        #pragma GCC unroll 8
        for (int t = 0; t < TILE; ++t) {
          _mm512_store_ps(sd[t], _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(k, ad[t] + b)));
        }
      }
      const bool half = 64 * (i + 1) > K;
      __m512i w0, w1;
      load_step<BITS>(row, i, half, w0, w1);
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const int16_t* a = aq[t] + i * 64;
        // (a lone last block: its 32 words, as W0 and W1 of 4 bits want them, or all in W0)
        const bool split = half && BITS == 4;
        const __m512i a0 = split ? _mm512_maskz_loadu_epi16(0xFFFF, a) : _mm512_loadu_si512(a);
        const __m512i a1 = split ? _mm512_maskz_loadu_epi16(0xFFFF, a + 16)
                                 : half ? _mm512_setzero_si512() : _mm512_loadu_si512(a + 32);
        const float* f = sd[t] + j;
        if constexpr (BITS == 4 && BLOCK == 32) {  // both products over the same blocks
          const __m512i dot = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, a0), w1, a1);
          into[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), spread(f, 0, half ? 0 : 1), into[t]);
        } else if (half) {  // the lone block: lanes 0-7 of each product (BITS == 4), or W0 alone
          const __m512i d0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, a0);
          into[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), spread(f, lanes[0][0], lanes[0][BITS == 8]), into[t]);
          if constexpr (BITS == 4) {
            const __m512i d1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w1, a1);
            into[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), spread(f, lanes[1][0], lanes[1][0]), into[t]);
          }
        } else {
          const __m512i d0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, a0);
          const __m512i d1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w1, a1);
          into[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), spread(f, lanes[0][0], lanes[0][1]), into[t]);
          into[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), spread(f, lanes[1][0], lanes[1][1]), into[t]);
        }
      }
    };
    int64_t i = 0;
    for (; i + 1 < steps; i += 2) {  // two accumulators: even and odd steps
      step(i, acc);
      step(i + 1, acc2);
    }
    if (i < steps) step(i, acc);
    #pragma GCC unroll 8
    for (int t = 0; t < TILE; ++t) {
      out[(m0 + t) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
    }
#else
    float extra[TILE];
    for (int t = 0; t < TILE; ++t) {
      extra[t] = block_part<OFFSET>(s, o, p.da.data() + (m0 + t) * per_row, per_row, zero);
    }
    const int64_t G = K / kGroup;
    float acc[TILE] = {};
    uint8_t w[kGroup];
    for (int64_t g = 0; g < G; ++g) {
      if constexpr (BITS == 8) {
        std::copy(row + g * kGroup, row + (g + 1) * kGroup, w);
      } else {
        for (int j = 0; j < 16; ++j) {
          w[j] = row[g * 16 + j] & 0x0F;
          w[j + 16] = row[g * 16 + j] >> 4;
        }
      }
      for (int t = 0; t < TILE; ++t) {
        const int16_t* a = aq[t] + g * kGroup;
        int32_t dot[2] = {0, 0};
        for (int j = 0; j < kGroup; ++j) dot[j / 16] += static_cast<int32_t>(w[j]) * a[j];
        if constexpr (BLOCK == 32) {
          acc[t] += to_float(s[g]) * ad[t][g] * static_cast<float>(dot[0] + dot[1]);
        } else {
          acc[t] += to_float(s[2 * g]) * ad[t][2 * g] * static_cast<float>(dot[0]) +
                    to_float(s[2 * g + 1]) * ad[t][2 * g + 1] * static_cast<float>(dot[1]);
        }
      }
    }
    for (int t = 0; t < TILE; ++t) out[(m0 + t) * N + n] = acc[t] + extra[t];
#endif
  }
}

template <int BITS, int BLOCK, bool OFFSET, typename S>
void run(const Rounded& r, int64_t M, int64_t K, int64_t N, const uint8_t* values,
         const S* scale, const S* offset, int32_t zero, float* out) {
  thread_local Prepared kept;  // the calling thread's, kept between calls
  Prepared& p = kept;  // (the workers below must see this one, not their own thread_local)
  prepare<BLOCK>(r, M, K, p);
  // weight rows split among the threads; each thread runs every activation row over its rows,
  // so that a weight block is read from memory once per tile of activation rows
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K / 32));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    for (; m0 + kTile <= M; m0 += kTile) {
      multiply<BITS, BLOCK, OFFSET, kTile, S>(r, p, K, N, values, scale, offset, zero, m0, n0, n1, out);
    }
    switch (M - m0) {
      case 3: multiply<BITS, BLOCK, OFFSET, 3, S>(r, p, K, N, values, scale, offset, zero, m0, n0, n1, out); break;
      case 2: multiply<BITS, BLOCK, OFFSET, 2, S>(r, p, K, N, values, scale, offset, zero, m0, n0, n1, out); break;
      case 1: multiply<BITS, BLOCK, OFFSET, 1, S>(r, p, K, N, values, scale, offset, zero, m0, n0, n1, out); break;
      default: break;
    }
  });
}

// checks shared by both ops: values (N, K · bits / 8) uint8, scale (N, K / block) fp32 or fp16,
// offset absent or shaped and typed as scale
void check_blocks(const at::Tensor& values, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& offset, int64_t bits, int64_t block, int64_t K) {
  TORCH_CHECK(values.scalar_type() == at::kByte && values.dim() == 2, "values must be (N, bytes) uint8");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(values.size(1) == K * bits / 8, "values do not hold K values a row");
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) &&
                  scale.dim() == 2 && scale.size(0) == values.size(0) && scale.size(1) == K / block,
              "scale must be (N, K / block) fp32 or fp16");
  if (offset.has_value() && offset->defined()) {
    TORCH_CHECK(offset->scalar_type() == scale.scalar_type() && offset->sizes() == scale.sizes(),
                "offset must be shaped and typed as scale");
  }
}

template <typename S>
void qmm_as(const Rounded& r, const at::Tensor& values, const at::Tensor& scale,
            const at::Tensor& offset, int64_t bits, int64_t block, int64_t zero, int64_t M,
            int64_t K, at::Tensor& out) {
  const int64_t N = values.size(0);
  const uint8_t* v = values.data_ptr<uint8_t>();
  const S* s = scale.data_ptr<S>();
  const S* o = offset.defined() ? offset.data_ptr<S>() : nullptr;
  float* y = out.data_ptr<float>();
  const int32_t z = static_cast<int32_t>(zero);
  const bool has_offset = o != nullptr;
#define DIKKAT_RUN(B, L, O) run<B, L, O, S>(r, M, K, N, v, s, o, z, y)
  if (bits == 8 && block == 32) { if (has_offset) DIKKAT_RUN(8, 32, true); else DIKKAT_RUN(8, 32, false); }
  else if (bits == 8) { if (has_offset) DIKKAT_RUN(8, 16, true); else DIKKAT_RUN(8, 16, false); }
  else if (block == 32) { if (has_offset) DIKKAT_RUN(4, 32, true); else DIKKAT_RUN(4, 32, false); }
  else { if (has_offset) DIKKAT_RUN(4, 16, true); else DIKKAT_RUN(4, 16, false); }
#undef DIKKAT_RUN
}

at::Tensor qmm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scale,
               const c10::optional<at::Tensor>& offset, int64_t bits, int64_t block, int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0);
  check_blocks(values, scale, offset, bits, block, K);
  const bool has_offset = offset.has_value() && offset->defined();
  const at::Tensor xc = x.contiguous(), vc = values.contiguous(), sc = scale.contiguous();
  const at::Tensor oc = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  thread_local Rounded r;  // the calling thread's, kept between calls
  round_rows(xc.data_ptr<float>(), M, K, r);
#if DIKKAT_VNNI
  if (bits == 4) nibble_order(r.q.data(), M, K);
#endif
  if (sc.scalar_type() == at::kHalf) {
    qmm_as<at::Half>(r, vc, sc, oc, bits, block, zero, M, K, out);
  } else {
    qmm_as<float>(r, vc, sc, oc, bits, block, zero, M, K, out);
  }
  return out;
}

template <typename S>
void dequantize_as(const uint8_t* v, const S* s, const S* o, int64_t bits, int64_t block,
                   int64_t zero, int64_t N, int64_t K, float* w) {
  const int64_t per_row = K / block;
  const float z = static_cast<float>(zero);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> q(K);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = v + n * (K * bits / 8);
      if (bits == 8) {
        for (int64_t k = 0; k < K; ++k) q[k] = static_cast<float>(row[k]);
      } else {
        for (int64_t g = 0; g < K / kGroup; ++g) {
          for (int j = 0; j < 16; ++j) {
            q[g * 32 + j] = static_cast<float>(row[g * 16 + j] & 0x0F);
            q[g * 32 + j + 16] = static_cast<float>(row[g * 16 + j] >> 4);
          }
        }
      }
      float* out_row = w + n * K;
      for (int64_t b = 0; b < per_row; ++b) {
        const float sb = to_float(s[n * per_row + b]);
        const float* qb = q.data() + b * block;
        float* wb = out_row + b * block;
        if (o != nullptr) {
          const float add = to_float(o[n * per_row + b]);
          for (int64_t j = 0; j < block; ++j) wb[j] = sb * qb[j] + add;
        } else {
          for (int64_t j = 0; j < block; ++j) wb[j] = sb * (qb[j] - z);
        }
      }
    }
  });
}

// the weight (N, K) that the blocks stand for, in fp32: a prefill multiplies it with oneDNN
at::Tensor dequantize(const at::Tensor& values, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& offset, int64_t bits, int64_t block,
                      int64_t zero) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t N = values.size(0), K = values.size(1) * 8 / bits;
  check_blocks(values, scale, offset, bits, block, K);
  const bool has_offset = offset.has_value() && offset->defined();
  const at::Tensor vc = values.contiguous(), sc = scale.contiguous();
  const at::Tensor oc = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor out = at::empty({N, K}, scale.options().dtype(at::kFloat));
  const uint8_t* v = vc.data_ptr<uint8_t>();
  float* w = out.data_ptr<float>();
  if (sc.scalar_type() == at::kHalf) {
    dequantize_as<at::Half>(v, sc.data_ptr<at::Half>(),
                            has_offset ? oc.data_ptr<at::Half>() : nullptr, bits, block, zero, N, K, w);
  } else {
    dequantize_as<float>(v, sc.data_ptr<float>(), has_offset ? oc.data_ptr<float>() : nullptr, bits,
                         block, zero, N, K, w);
  }
  return out;
}

bool vnni() { return DIKKAT_VNNI; }

}  // namespace

TORCH_LIBRARY(dikkat_native, m) {
  m.def("qmm(Tensor x, Tensor values, Tensor scale, Tensor? offset, int bits, int block, int zero) -> Tensor");
  m.def("dequantize(Tensor values, Tensor scale, Tensor? offset, int bits, int block, int zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) {
  m.impl("qmm", &qmm);
  m.impl("dequantize", &dequantize);
}

extern "C" int dikkat_native_vnni() { return vnni() ? 1 : 0; }
