// Products of fp32 activations with weights packed in blocks of 4-, 6- or 8-bit unsigned integers.
//
// A weight row of K values is stored as K/B blocks (B = 32, or 16); value j of block b is
//   scale[b] * (q[j] - zero)        (symmetric formats: no offset tensor), or
//   scale[b] * q[j] + offset[b]     (formats with a per-block minimum),
// scales and offsets in fp32, or in fp16 (a file's own fp16 values, read a quarter fewer bytes),
// or in two levels, as ggml's K-quants hold them: an int8 a block times an fp16 a super-block of
// 256 values (a block's fp32 scale is then exactly their product).
// 8-bit q: one byte a value. 4-bit q: 16 bytes a block of 32, byte j holding value j in its low
// nibble and value j + 16 in its high nibble (ggml's Q4_0 order,
// https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). 6-bit q: 24 bytes a block, the
// low 4 bits as 4-bit q holds them, then 8 bytes of top 2 bits (dikkat/layers/packed_bits.py).
// The product reads the weight in groups of 16 rows (dikkat/layers/packed_groups.py): see
// "A group's bytes" below.
//
// Each activation row is rounded to int16 per block of 32, a[j] = round(x[j] / d) with
// d = max|x| / 32767 (16 bits, not llama.cpp's 8: an 8-bit rounding of a block that holds one of
// a model's outlier features moves a real model's logits by tenths, and flips greedy tokens);
// the product is then exactly
//   sum over blocks of  scale * d * sum_j (q[j] - zero) * a[j]   (integers, exact), or
//                       d * (scale * sum_j q[j] a[j] + offset * sum_j a[j]),
// i.e. the dequantised weight times the rounded activations, summed in fp32. The integer sums
// use AVX-512 VNNI (vpdpwssd: 16-bit times 16-bit, two products into a 32-bit lane, a lane a
// weight row) where the compiler targets it; elsewhere plain loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define DIKKAT_VNNI 1
#else
#define DIKKAT_VNNI 0
#endif

namespace {

constexpr int64_t kGroup = 32;  // activation block
constexpr int64_t kTile = 8;     // activation rows multiplied with one unpacked weight group
constexpr int64_t kAhead = 4096;  // bytes of weights asked for ahead of their turn
constexpr int32_t kLevels = 32767;  // activations: round(x / d), d = max |x| / kLevels
constexpr int64_t kSuper = 256;  // values a super-block of two-level scales

// a two-level format's fp16 super-block scales (and offsets): (N, K / 256), as the int8 ones
struct Units {
  const at::Half* scale = nullptr;
  const at::Half* offset = nullptr;
};

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

struct Sums {  // per activation row and weight block of BLOCK values
  std::vector<float> da;     // (M, K / BLOCK): d times the sum of the block's rounded values
  std::vector<int32_t> zs;   // (M, K / BLOCK): -zero times that sum (symmetric formats)
};

template <int BLOCK>
void block_sums(const Rounded& r, int64_t M, int64_t K, int32_t zero, Sums& s) {
  const int64_t G = K / kGroup, per_row = K / BLOCK;
  s.da.resize(M * per_row);
  s.zs.resize(M * per_row);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < per_row; ++b) {
      const int64_t g = BLOCK == 32 ? b : b / 2;
      const int32_t* sum = r.sum.data() + (m * G + g) * 2;
      const int32_t total = BLOCK == 32 ? sum[0] + sum[1] : sum[b % 2];
      s.da[m * per_row + b] = r.d[m * G + g] * static_cast<float>(total);
      s.zs[m * per_row + b] = -zero * total;
    }
  }
}

// A group's bytes: chunk j (32 bytes) holds byte pair j of each of its 16 rows, row r's at
// 2 r; its scales (and offsets) 16 a block, row r's at r. Byte pair j of a row holds, for
// 8 bits, values 2 j and 2 j + 1; for 4 bits (16 bytes a block of 32), the low nibbles hold
// values 2 c, 2 c + 1 and the high ones 2 c + 16, 2 c + 17 of the row's 32-value block j / 8,
// c = j % 8. So an unpacked chunk is 16 lanes of two 16-bit weights, one lane a row, and
// vpdpwssd multiplies it with a broadcast pair of activations. 6 bits (24 bytes a block): 8
// chunks of low nibbles as for 4 bits, then 4 chunks of top bits; top chunk p, widened to
// 16-bit words, holds in bits 0-1, 2-3, 4-5 and 6-7 of its two words the top bits of the
// values of nibble chunk 2 p (low, high nibbles) and 2 p + 1 (low, high nibbles): a shift
// by 4, 2, 0 or -2 and a mask move them above the nibbles.
constexpr int64_t kRows = 16;  // weight rows a group

// the integer q of value k (of K) of row r, in a group's bytes (the scalar paths and the tail)
template <int BITS>
inline int32_t group_value(const uint8_t* group, int64_t r, int64_t k) {
  // the row's byte b, as a row holds it, in the group
  const auto at = [&](int64_t b) { return group[(b / 2) * 32 + 2 * r + b % 2]; };
  if constexpr (BITS == 8) {
    return at(k);
  } else {
    constexpr int64_t block_bytes = kGroup * BITS / 8;
    const int64_t i = k % 16, h = (k % 32) / 16, base = (k / 32) * block_bytes;
    const int32_t low = (at(base + i) >> (4 * h)) & 0x0F;
    if constexpr (BITS == 4) return low;
    const int32_t top = (at(base + 16 + (i / 4) * 2 + i % 2) >> (2 * (2 * ((i / 2) % 2) + h))) & 3;
    return low | (top << 4);
  }
}

// out[m, 16 g + lane] for the TILE activation rows from m0 and the group's rows (lanes < rows)
template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void multiply(const Rounded& r, const Sums& sums, int64_t K, int64_t N, const uint8_t* group,
              const S* scale, const S* offset, int64_t m0, int64_t n0, int64_t rows, float* out) {
  const int64_t G = K / kGroup, per_row = K / BLOCK;
  const int16_t* aq[TILE];
  const float* ad[TILE];
  const float* da[TILE];
  const int32_t* zs[TILE];
  for (int t = 0; t < TILE; ++t) {
    aq[t] = r.q.data() + (m0 + t) * K;
    ad[t] = r.d.data() + (m0 + t) * G;
    da[t] = sums.da.data() + (m0 + t) * per_row;
    zs[t] = sums.zs.data() + (m0 + t) * per_row;
  }
#if DIKKAT_VNNI
  constexpr int64_t chunk_bytes = kRows * 2, group_bytes = kRows * kGroup * BITS / 8;
  __m512 acc[TILE];
  // every loop over the tile's rows unrolled, so that the accumulators stay in registers
  #pragma GCC unroll 8
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = group + g * group_bytes;
    for (int64_t b = 0; b < group_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(c + kAhead + b), _MM_HINT_T0);
    // h0: values 0-15 of the block of 32, h1: values 16-31; a symmetric format's zero point
    // enters as -zero times the activations' sum, in integers
    __m512i h0[TILE], h1[TILE];
    #pragma GCC unroll 8
    for (int t = 0; t < TILE; ++t) {
      if constexpr (OFFSET) {
        h0[t] = h1[t] = _mm512_setzero_si512();
      } else if constexpr (BLOCK == 32) {
        h0[t] = _mm512_set1_epi32(zs[t][g]);
        h1[t] = _mm512_setzero_si512();
      } else {
        h0[t] = _mm512_set1_epi32(zs[t][2 * g]);
        h1[t] = _mm512_set1_epi32(zs[t][2 * g + 1]);
      }
    }
    #pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) {
      __m512i w0, w1;  // pairs j (values 2 j, 2 j + 1) and j + 8 (values 2 j + 16, 2 j + 17)
      if constexpr (BITS == 4 || BITS == 6) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * chunk_bytes)));
        w0 = _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
        w1 = _mm512_srli_epi16(w, 4);
        if constexpr (BITS == 6) {  // w | (top & 0x30), the top bits of nibble chunk j moved
          const __m512i top = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (8 + j / 2) * chunk_bytes)));
          const __m512i bits45 = _mm512_set1_epi16(0x30);
          constexpr int kOrMasked = 0xF8;  // a | (b & c): truth table over (a, b, c) as bits 2, 1, 0
          const __m512i t0 = j % 2 ? top : _mm512_slli_epi16(top, 4);
          const __m512i t1 = j % 2 ? _mm512_srli_epi16(top, 2) : _mm512_slli_epi16(top, 2);
          w0 = _mm512_ternarylogic_epi32(w0, t0, bits45, kOrMasked);
          w1 = _mm512_ternarylogic_epi32(w1, t1, bits45, kOrMasked);
        }
      } else {
        w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * chunk_bytes)));
        w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (j + 8) * chunk_bytes)));
      }
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const int16_t* a = aq[t] + g * kGroup + 2 * j;
        h0[t] = _mm512_dpwssd_epi32(h0[t], w0, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a)));
        h1[t] = _mm512_dpwssd_epi32(h1[t], w1, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + 16)));
      }
    }
    if constexpr (BLOCK == 32) {
      const __m512 s = load16(scale + g * kRows, 0xFFFF);
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(ad[t][g]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0[t], h1[t])), sd, acc[t]);
        if constexpr (OFFSET) {
          acc[t] = _mm512_fmadd_ps(load16(offset + g * kRows, 0xFFFF), _mm512_set1_ps(da[t][g]), acc[t]);
        }
      }
    } else {
      const __m512 s0 = load16(scale + 2 * g * kRows, 0xFFFF), s1 = load16(scale + (2 * g + 1) * kRows, 0xFFFF);
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const __m512 d = _mm512_set1_ps(ad[t][g]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0[t]), _mm512_mul_ps(s0, d), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1[t]), _mm512_mul_ps(s1, d), acc[t]);
        if constexpr (OFFSET) {
          acc[t] = _mm512_fmadd_ps(load16(offset + 2 * g * kRows, 0xFFFF), _mm512_set1_ps(da[t][2 * g]), acc[t]);
          acc[t] = _mm512_fmadd_ps(load16(offset + (2 * g + 1) * kRows, 0xFFFF), _mm512_set1_ps(da[t][2 * g + 1]), acc[t]);
        }
      }
    }
  }
  const __mmask16 lanes = rows >= kRows ? 0xFFFF : (1u << rows) - 1;
  #pragma GCC unroll 8
  for (int t = 0; t < TILE; ++t) _mm512_mask_storeu_ps(out + (m0 + t) * N + n0, lanes, acc[t]);
#else
  for (int t = 0; t < TILE; ++t) {
    for (int64_t l = 0; l < rows; ++l) {
      float acc = 0.f;
      for (int64_t b = 0; b < per_row; ++b) {
        int32_t dot = OFFSET ? 0 : zs[t][b];
        for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; ++k) dot += group_value<BITS>(group, l, k) * aq[t][k];
        const float s = to_float(scale[b * kRows + l]);
        acc += s * ad[t][b * BLOCK / kGroup] * static_cast<float>(dot);
        if constexpr (OFFSET) acc += to_float(offset[b * kRows + l]) * da[t][b];
      }
      out[(m0 + t) * N + n0 + l] = acc;
    }
  }
#endif
}

// a block's scale (or offset) in fp32: element i of a plain one, or for two levels element i
// of the int8 ones times element u of the fp16 super-block ones
template <typename S>
inline float scale_at(const S* s, const at::Half*, int64_t i, int64_t) { return to_float(s[i]); }
inline float scale_at(const int8_t* s, const at::Half* unit, int64_t i, int64_t u) {
  return static_cast<float>(s[i]) * static_cast<float>(unit[u]);
}

// a full group's two-level scales (or offsets) in fp32, as the group holds them: block b of row
// r at 16 b + r, its super-block's fp16 at 16 (b · BLOCK / 256) + r
template <int BLOCK>
void expand_group(const int8_t* s, const at::Half* unit, int64_t per_row, float* out) {
  constexpr int64_t per_unit = kSuper / BLOCK;
  for (int64_t b = 0; b < per_row; ++b) {
#if DIKKAT_VNNI
    const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b * kRows))));
    _mm512_storeu_ps(out + b * kRows, _mm512_mul_ps(sub, load16(unit + (b / per_unit) * kRows, 0xFFFF)));
#else
    for (int64_t r = 0; r < kRows; ++r) out[b * kRows + r] = scale_at(s, unit, b * kRows + r, (b / per_unit) * kRows + r);
#endif
  }
}

// a last group of fewer than 16 rows, kept row by row, laid out as a group (zeros past its
// rows), its scales and offsets in fp32
template <int BITS, int BLOCK, typename S>
void tail_group(const uint8_t* values, const S* scale, const S* offset, const Units& units,
                int64_t rows, int64_t K, std::vector<uint8_t>& v, std::vector<float>& s,
                std::vector<float>& o) {
  const int64_t row_bytes = K * BITS / 8, per_row = K / BLOCK, per_unit = kSuper / BLOCK;
  const int64_t unit_row = std::max<int64_t>(1, K / kSuper);
  v.assign(kRows * row_bytes, 0);
  s.assign(kRows * per_row, 0.f);
  o.assign(offset != nullptr ? kRows * per_row : 0, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < row_bytes; ++i) v[(i / 2) * 32 + 2 * r + i % 2] = values[r * row_bytes + i];
    for (int64_t b = 0; b < per_row; ++b) {
      const int64_t u = r * unit_row + b / per_unit;
      s[b * kRows + r] = scale_at(scale, units.scale, r * per_row + b, u);
      if (offset != nullptr) o[b * kRows + r] = scale_at(offset, units.offset, r * per_row + b, u);
    }
  }
}

template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void tiles_of(const Rounded& r, const Sums& sums, int64_t M, int64_t K, int64_t N,
              const uint8_t* group, const S* scale, const S* offset, int64_t n0, int64_t rows,
              float* out) {
  int64_t m0 = 0;
  for (; m0 + TILE <= M; m0 += TILE) {
    multiply<BITS, BLOCK, OFFSET, TILE, S>(r, sums, K, N, group, scale, offset, m0, n0, rows, out);
  }
  switch (M - m0) {
#define DIKKAT_TILE(T) multiply<BITS, BLOCK, OFFSET, T, S>(r, sums, K, N, group, scale, offset, m0, n0, rows, out)
    case 7: DIKKAT_TILE(7); break;
    case 6: DIKKAT_TILE(6); break;
    case 5: DIKKAT_TILE(5); break;
    case 4: DIKKAT_TILE(4); break;
    case 3: DIKKAT_TILE(3); break;
    case 2: DIKKAT_TILE(2); break;
    case 1: DIKKAT_TILE(1); break;
    default: break;
#undef DIKKAT_TILE
  }
}

// S: float, at::Half, or int8_t (two levels, with units): a group's two-level scales are
// expanded to fp32 before its products, 16 · K / BLOCK of them (a few kB, in L1)
template <int BITS, int BLOCK, bool OFFSET, typename S>
void run(const Rounded& r, int64_t M, int64_t K, int64_t N, const uint8_t* values,
         const S* scale, const S* offset, const Units& units, int32_t zero, float* out) {
  thread_local Sums kept;  // the calling thread's, kept between calls
  Sums& sums = kept;  // (the workers below must see this one, not their own thread_local)
  block_sums<BLOCK>(r, M, K, zero, sums);
  const int64_t row_bytes = K * BITS / 8, per_row = K / BLOCK;
  const int64_t full = N / kRows, groups = (N + kRows - 1) / kRows;
  // weight groups split among the threads; each thread runs every activation row over its
  // groups, so that a group is read from memory once (and from cache for the next tiles)
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, K / 32));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kRows;
      const S* o = OFFSET ? offset + n0 * per_row : nullptr;
      if (g < full) {
        if constexpr (std::is_same_v<S, int8_t>) {
          thread_local std::vector<float> s32, o32;  // this worker's
          const int64_t units_at = n0 * (K / kSuper);
          s32.resize(kRows * per_row);
          o32.resize(OFFSET ? kRows * per_row : 0);
          expand_group<BLOCK>(scale + n0 * per_row, units.scale + units_at, per_row, s32.data());
          if (OFFSET) expand_group<BLOCK>(o, units.offset + units_at, per_row, o32.data());
          tiles_of<BITS, BLOCK, OFFSET, kTile, float>(r, sums, M, K, N, values + n0 * row_bytes, s32.data(),
                                                      OFFSET ? o32.data() : nullptr, n0, kRows, out);
        } else {
          tiles_of<BITS, BLOCK, OFFSET, kTile, S>(r, sums, M, K, N, values + n0 * row_bytes,
                                                  scale + n0 * per_row, o, n0, kRows, out);
        }
      } else {
        std::vector<uint8_t> v;
        std::vector<float> s, o32;
        const Units tail{units.scale ? units.scale + n0 * (K / kSuper) : nullptr,
                         units.offset ? units.offset + n0 * (K / kSuper) : nullptr};
        tail_group<BITS, BLOCK, S>(values + n0 * row_bytes, scale + n0 * per_row, o, tail, N - n0, K, v, s, o32);
        tiles_of<BITS, BLOCK, OFFSET, kTile, float>(r, sums, M, K, N, v.data(), s.data(),
                                                    OFFSET ? o32.data() : nullptr, n0, N - n0, out);
      }
    }
  });
}

// checks shared by both ops: values (N, K · bits / 8) uint8, scale (N, K / block) fp32 or fp16
// (or int8: see check_units), offset absent or shaped and typed as scale
void check_blocks(const at::Tensor& values, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& offset, int64_t bits, int64_t block, int64_t K,
                  bool two_level = false) {
  TORCH_CHECK(values.scalar_type() == at::kByte && values.dim() == 2, "values must be (N, bytes) uint8");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32");
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(values.size(1) == K * bits / 8, "values do not hold K values a row");
  const bool typed = two_level ? scale.scalar_type() == at::kChar
                               : scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf;
  TORCH_CHECK(typed && scale.dim() == 2 && scale.size(0) == values.size(0) && scale.size(1) == K / block,
              "scale must be (N, K / block) fp32 or fp16, or int8 with super_scale");
  if (offset.has_value() && offset->defined()) {
    TORCH_CHECK(offset->scalar_type() == scale.scalar_type() && offset->sizes() == scale.sizes(),
                "offset must be shaped and typed as scale");
  }
}

// a two-level scale's fp16 super-block values: (N, K / 256), present with an int8 scale (and
// offset), absent otherwise
void check_units(const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                 const c10::optional<at::Tensor>& super_scale,
                 const c10::optional<at::Tensor>& super_offset, int64_t N, int64_t K) {
  const bool two_level = scale.scalar_type() == at::kChar;
  const bool has_offset = offset.has_value() && offset->defined();
  const auto present = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(present(super_scale) == two_level, "super_scale goes with an int8 scale, and only with one");
  TORCH_CHECK(present(super_offset) == (two_level && has_offset),
              "super_offset goes with an int8 scale and offset, and only with them");
  for (const auto* t : {&super_scale, &super_offset}) {
    if (!present(*t)) continue;
    TORCH_CHECK(K % kSuper == 0, "two-level scales need K a multiple of 256");
    TORCH_CHECK((*t)->scalar_type() == at::kHalf && (*t)->dim() == 2 && (*t)->size(0) == N &&
                    (*t)->size(1) == K / kSuper,
                "super_scale and super_offset must be (N, K / 256) fp16");
  }
}

template <typename S>
void qmm_as(const Rounded& r, const at::Tensor& values, const at::Tensor& scale,
            const at::Tensor& offset, const Units& units, int64_t bits, int64_t block,
            int64_t zero, int64_t M, int64_t K, at::Tensor& out) {
  const int64_t N = values.size(0);
  const uint8_t* v = values.data_ptr<uint8_t>();
  const S* s = scale.data_ptr<S>();
  const S* o = offset.defined() ? offset.data_ptr<S>() : nullptr;
  float* y = out.data_ptr<float>();
  const int32_t z = static_cast<int32_t>(zero);
  const bool has_offset = o != nullptr;
#define DIKKAT_RUN(B, L, O) run<B, L, O, S>(r, M, K, N, v, s, o, units, z, y)
  if (bits == 8 && block == 32) { if (has_offset) DIKKAT_RUN(8, 32, true); else DIKKAT_RUN(8, 32, false); }
  else if (bits == 8) { if (has_offset) DIKKAT_RUN(8, 16, true); else DIKKAT_RUN(8, 16, false); }
  else if (bits == 6 && block == 32) { if (has_offset) DIKKAT_RUN(6, 32, true); else DIKKAT_RUN(6, 32, false); }
  else if (bits == 6) { if (has_offset) DIKKAT_RUN(6, 16, true); else DIKKAT_RUN(6, 16, false); }
  else if (block == 32) { if (has_offset) DIKKAT_RUN(4, 32, true); else DIKKAT_RUN(4, 32, false); }
  else { if (has_offset) DIKKAT_RUN(4, 16, true); else DIKKAT_RUN(4, 16, false); }
#undef DIKKAT_RUN
}

at::Tensor qmm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scale,
               const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& super_scale,
               const c10::optional<at::Tensor>& super_offset, int64_t bits, int64_t block,
               int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0);
  const bool two_level = scale.scalar_type() == at::kChar;
  check_blocks(values, scale, offset, bits, block, K, two_level);
  check_units(scale, offset, super_scale, super_offset, N, K);
  const at::Tensor us = two_level ? super_scale->contiguous() : at::Tensor();
  const at::Tensor uo = two_level && offset.has_value() && offset->defined() ? super_offset->contiguous() : at::Tensor();
  const Units units{us.defined() ? us.data_ptr<at::Half>() : nullptr,
                    uo.defined() ? uo.data_ptr<at::Half>() : nullptr};
  const bool has_offset = offset.has_value() && offset->defined();
  const at::Tensor xc = x.contiguous(), vc = values.contiguous(), sc = scale.contiguous();
  const at::Tensor oc = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  thread_local Rounded r;  // the calling thread's, kept between calls
  round_rows(xc.data_ptr<float>(), M, K, r);
  if (two_level) {
    qmm_as<int8_t>(r, vc, sc, oc, units, bits, block, zero, M, K, out);
  } else if (sc.scalar_type() == at::kHalf) {
    qmm_as<at::Half>(r, vc, sc, oc, units, bits, block, zero, M, K, out);
  } else {
    qmm_as<float>(r, vc, sc, oc, units, bits, block, zero, M, K, out);
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
        const int64_t block_bytes = kGroup * bits / 8;
        for (int64_t g = 0; g < K / kGroup; ++g) {
          const uint8_t* b = row + g * block_bytes;
          for (int j = 0; j < 32; ++j) {
            const int i = j % 16, h = j / 16;
            int value = (b[i] >> (4 * h)) & 0x0F;
            if (bits == 6) value |= ((b[16 + (i / 4) * 2 + i % 2] >> (2 * (2 * ((i / 2) % 2) + h))) & 3) << 4;
            q[g * 32 + j] = static_cast<float>(value);
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
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
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
  m.def("qmm(Tensor x, Tensor values, Tensor scale, Tensor? offset, Tensor? super_scale, "
        "Tensor? super_offset, int bits, int block, int zero) -> Tensor");
  m.def("dequantize(Tensor values, Tensor scale, Tensor? offset, int bits, int block, int zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) {
  m.impl("qmm", &qmm);
  m.impl("dequantize", &dequantize);
}

extern "C" int dikkat_native_vnni() { return vnni() ? 1 : 0; }
