// Products of fp32 activations with weights packed in blocks of 4-, 6- or 8-bit unsigned integers,
// held in groups of 16 rows (qmm_layout.h says how the blocks and groups lie).
//
// Each activation row is rounded to int16 per block of 32, a[j] = round(x[j] / d) with
// d = max|x| / 32767 (16 bits, not llama.cpp's 8: an 8-bit rounding of a block that holds one of
// a model's outlier features moves a real model's logits by tenths, and flips greedy tokens);
// the product is then exactly
//   sum over blocks of  scale * d * sum_j (q[j] - zero) * a[j]   (integers, exact), or
//                       d * (scale * sum_j q[j] a[j] + offset * sum_j a[j]),
// i.e. the dequantised weight times the rounded activations, summed in fp32. The integer sums
// use AVX-512 VNNI (vpdpwssd: 16-bit times 16-bit, two products into a 32-bit lane, a lane a
// weight row) where the compiler targets it (qmm_vnni.h), AVX2's vpmaddwd where that is the best
// it has (qmm_avx2.h); elsewhere plain loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "qmm_layout.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include "qmm_vnni.h"
#define DIKKAT_VNNI 1
#define DIKKAT_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "qmm_avx2.h"
#define DIKKAT_VNNI 0
#define DIKKAT_AVX2 1
#else
#define DIKKAT_VNNI 0
#define DIKKAT_AVX2 0
#endif

namespace {

// activation rows multiplied with one unpacked weight group: as many as keep their sums in
// registers (32 of them in AVX-512, 16 in AVX2)
constexpr int64_t kTile = DIKKAT_AVX2 ? 4 : 8;
constexpr int32_t kLevels = 32767;  // activations: round(x / d), d = max |x| / kLevels

struct Rounded {
  std::vector<int16_t> q;    // (M, K)
  std::vector<float> d;      // (M, K / 32) block scales
  std::vector<int32_t> sum;  // (M, K / 16) sums of the rounded values, per 16
  std::vector<uint8_t> odd;  // (M): whether the row holds a NaN or ±Inf (rounded as zeros)
};

constexpr float kFinite = std::numeric_limits<float>::max();  // a NaN or ±Inf fails |x| <= it

void round_rows(const float* x, int64_t M, int64_t K, Rounded& r) {
  const int64_t G = K / kGroup;
  r.q.resize(M * K);
  r.d.resize(M * G);
  r.sum.resize(M * G * 2);
  r.odd.assign(M, 0);
  // a NaN or ±Inf is rounded as a zero, and its row marked: add_nonfinite adds its terms
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* v = x + m * K + g * kGroup;
        int16_t* q = r.q.data() + m * K + g * kGroup;
#if DIKKAT_VNNI
        __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        const __m512 finite = _mm512_set1_ps(kFinite);  // |v| > it, or unordered: NaN or ±Inf
        const __mmask16 odd0 = _mm512_cmp_ps_mask(_mm512_abs_ps(v0), finite, _CMP_NLE_UQ);
        const __mmask16 odd1 = _mm512_cmp_ps_mask(_mm512_abs_ps(v1), finite, _CMP_NLE_UQ);
        if ((odd0 | odd1) != 0) [[unlikely]] {
          v0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(~odd0), v0);
          v1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(~odd1), v1);
          r.odd[m] = 1;
        }
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
        bool odd = false;
        for (int j = 0; j < kGroup; ++j) {
          amax = std::max(amax, std::fabs(v[j]));
          odd |= !(std::fabs(v[j]) <= kFinite);
        }
        float kept[kGroup];
        if (odd) [[unlikely]] {
          amax = 0.f;
          for (int j = 0; j < kGroup; ++j) {
            kept[j] = std::fabs(v[j]) <= kFinite ? v[j] : 0.f;
            amax = std::max(amax, std::fabs(kept[j]));
          }
          v = kept;
          r.odd[m] = 1;
        }
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

// out[m, 16 g + lane] for the TILE activation rows from m0 and the group's rows (lanes < rows);
// TO_L2: the weights ahead are asked for into L2 only (qmm_vnni.h)
template <int BITS, int BLOCK, bool OFFSET, int TILE, bool TO_L2, typename S>
void multiply(const Rounded& r, const Sums& sums, int64_t K, int64_t N, const uint8_t* group,
              const S* scale, const S* offset, int64_t m0, int64_t n0, int64_t rows, float* out) {
  const int64_t G = K / kGroup, per_row = K / BLOCK;
  Tile<TILE> a;
  for (int t = 0; t < TILE; ++t) {
    a.aq[t] = r.q.data() + (m0 + t) * K;
    a.ad[t] = r.d.data() + (m0 + t) * G;
    a.da[t] = sums.da.data() + (m0 + t) * per_row;
    a.zs[t] = sums.zs.data() + (m0 + t) * per_row;
    a.out[t] = out + (m0 + t) * N + n0;
  }
#if DIKKAT_VNNI
  group_vnni<BITS, BLOCK, OFFSET, TILE, TO_L2, S>(a, G, group, scale, offset, rows);
#elif DIKKAT_AVX2
  // (its prefetches go to L1: into L2 was measured on a DRAM-bound matrix only in VNNI)
  group_avx2<BITS, BLOCK, OFFSET, TILE, S>(a, G, group, scale, offset, rows);
#else
  for (int t = 0; t < TILE; ++t) {
    for (int64_t l = 0; l < rows; ++l) {
      float acc = 0.f;
      for (int64_t b = 0; b < per_row; ++b) {
        int32_t dot = OFFSET ? 0 : a.zs[t][b];
        for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; ++k) dot += group_value<BITS>(group, l, k) * a.aq[t][k];
        const float s = to_float(scale[b * kRows + l]);
        acc += s * a.ad[t][b * BLOCK / kGroup] * static_cast<float>(dot);
        if constexpr (OFFSET) acc += to_float(offset[b * kRows + l]) * a.da[t][b];
      }
      a.out[t][l] = acc;
    }
  }
#endif
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

// the activation rows [m0, M), at most TILE of them, over one weight group that no other rows
// multiply: 6-bit weights read so are asked for into L2 only (qmm_vnni.h), the other widths
// as the tiles of a longer run are (so they share its code)
template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void tile_once(const Rounded& r, const Sums& sums, int64_t M, int64_t K, int64_t N,
               const uint8_t* group, const S* scale, const S* offset, int64_t n0, int64_t rows,
               float* out, int64_t m0) {
  if (M - m0 == TILE) {
    multiply<BITS, BLOCK, OFFSET, TILE, BITS == 6, S>(r, sums, K, N, group, scale, offset, m0, n0, rows, out);
  } else if constexpr (TILE > 1) {
    tile_once<BITS, BLOCK, OFFSET, TILE - 1, S>(r, sums, M, K, N, group, scale, offset, n0, rows, out, m0);
  }
}

// the activation rows [m_begin, M) over one weight group, TILE rows at a time
template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void tiles_of(const Rounded& r, const Sums& sums, int64_t M, int64_t K, int64_t N,
              const uint8_t* group, const S* scale, const S* offset, int64_t n0, int64_t rows,
              float* out, int64_t m_begin = 0) {
  if (M - m_begin <= TILE) {  // one tile: the group is read once
    tile_once<BITS, BLOCK, OFFSET, TILE, S>(r, sums, M, K, N, group, scale, offset, n0, rows, out, m_begin);
    return;
  }
  int64_t m0 = m_begin;
  for (; m0 + TILE <= M; m0 += TILE) {
    multiply<BITS, BLOCK, OFFSET, TILE, false, S>(r, sums, K, N, group, scale, offset, m0, n0, rows, out);
  }
  switch (M - m0) {
#define DIKKAT_TILE(T) multiply<BITS, BLOCK, OFFSET, T, false, S>(r, sums, K, N, group, scale, offset, m0, n0, rows, out)
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

// The full group of 16 weight rows from row n0 times the activation rows [m0, M), into columns
// col … col + 15 of out (rows of N). S: float, at::Half, or int8_t (two levels, with units): a
// group's two-level scales are expanded to fp32 first, 16 · K / BLOCK of them (a few kB, in L1)
template <int BITS, int BLOCK, bool OFFSET, typename S>
void full_group(const Rounded& r, const Sums& sums, int64_t m0, int64_t M, int64_t K, int64_t N,
                const uint8_t* values, const S* scale, const S* offset, const Units& units,
                int64_t n0, int64_t col, float* out) {
  const int64_t row_bytes = K * BITS / 8, per_row = K / BLOCK;
  const S* o = OFFSET ? offset + n0 * per_row : nullptr;
  if constexpr (std::is_same_v<S, int8_t>) {
    thread_local std::vector<float> s32, o32;  // this worker's
    const int64_t units_at = n0 * (K / kSuper);
    s32.resize(kRows * per_row);
    o32.resize(OFFSET ? kRows * per_row : 0);
    expand_group<BLOCK>(scale + n0 * per_row, units.scale + units_at, per_row, s32.data());
    if (OFFSET) expand_group<BLOCK>(o, units.offset + units_at, per_row, o32.data());
    tiles_of<BITS, BLOCK, OFFSET, kTile, float>(r, sums, M, K, N, values + n0 * row_bytes, s32.data(),
                                                OFFSET ? o32.data() : nullptr, col, kRows, out, m0);
  } else {
    tiles_of<BITS, BLOCK, OFFSET, kTile, S>(r, sums, M, K, N, values + n0 * row_bytes,
                                            scale + n0 * per_row, o, col, kRows, out, m0);
  }
}

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
        full_group<BITS, BLOCK, OFFSET, S>(r, sums, 0, M, K, N, values, scale, offset, units, n0, n0, out);
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

// Each activation row with its own block of R weight rows, [ids[m] · R, ids[m] · R + R) of the
// weight (a mixture's experts stacked, row m's expert): out (M, R). R is a multiple of 16, so
// that a block is whole groups. Consecutive rows of one id (the caller sorts them) run as one
// run: each group of the run's block is read once for all of its rows, TILE at a time.
template <int BITS, int BLOCK, bool OFFSET, typename S>
void run_ids(const Rounded& r, int64_t M, int64_t K, int64_t R, const int64_t* ids,
             const uint8_t* values, const S* scale, const S* offset, const Units& units,
             int32_t zero, float* out) {
  thread_local Sums kept;
  Sums& sums = kept;
  block_sums<BLOCK>(r, M, K, zero, sums);
  const int64_t groups = R / kRows;
  std::vector<int64_t> starts;  // where each run of one id begins, and M
  for (int64_t m = 0; m < M; ++m) {
    if (m == 0 || ids[m] != ids[m - 1]) starts.push_back(m);
  }
  starts.push_back(M);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, K / 32));
  at::parallel_for(0, runs * groups, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t run = i / groups, g = i % groups;
      const int64_t m0 = starts[run], m1 = starts[run + 1];
      const int64_t n0 = ids[m0] * R + g * kRows;  // in the stacked weight
      full_group<BITS, BLOCK, OFFSET, S>(r, sums, m0, m1, K, R, values, scale, offset, units, n0, g * kRows, out);
    }
  });
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

// The rows of x that hold a NaN or ±Inf, which the integer product took as zeros there: their
// outputs become what IEEE arithmetic gives for the dequantised weight times x. A NaN makes every
// output of its row NaN; an Inf's terms w[n, k] · x[m, k] are added in fp32 (±Inf, or NaN where
// the weight is 0 or terms of both signs meet), a few per row, not a product's worth of work.
template <typename S>
void add_nonfinite(const float* x, const std::vector<uint8_t>& odd, const Weight<S>& w, float* out) {
  const int64_t K = w.K, N = w.N;
  std::vector<int64_t> at_inf;
  for (int64_t m = 0; m < static_cast<int64_t>(odd.size()); ++m) {
    if (!odd[m]) continue;
    const float* row = x + m * K;
    float* y = out + m * N;
    at_inf.clear();
    bool nan = false;
    for (int64_t k = 0; k < K; ++k) {
      nan |= std::isnan(row[k]);
      if (std::isinf(row[k])) at_inf.push_back(k);
    }
    if (nan) {
      std::fill(y, y + N, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        float terms = 0.f;
        for (const int64_t k : at_inf) terms += w.at(n, k) * row[k];
        y[n] += terms;
      }
    });
  }
}

template <typename S>
void qmm_as(const float* x, const Rounded& r, const at::Tensor& values, const at::Tensor& scale,
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
  if (std::find(r.odd.begin(), r.odd.end(), 1) != r.odd.end()) [[unlikely]] {
    add_nonfinite<S>(x, r.odd, Weight<S>{v, s, o, units, N, K, bits, block, z}, y);
  }
}

// a packed weight's tensors as the products read them: checked against K, contiguous, and its
// two-level scales' fp16 units (Units points into units_scale / units_offset, held here)
struct Blocks {
  at::Tensor values, scale, offset, units_scale, units_offset;
  Units units;
  bool two_level = false;
};

Blocks blocks_of(const at::Tensor& values, const at::Tensor& scale,
                 const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& super_scale,
                 const c10::optional<at::Tensor>& super_offset, int64_t bits, int64_t block, int64_t K) {
  Blocks b;
  b.two_level = scale.scalar_type() == at::kChar;
  check_blocks(values, scale, offset, bits, block, K, b.two_level);
  check_units(scale, offset, super_scale, super_offset, values.size(0), K);
  const bool has_offset = offset.has_value() && offset->defined();
  b.units_scale = b.two_level ? super_scale->contiguous() : at::Tensor();
  b.units_offset = b.two_level && has_offset ? super_offset->contiguous() : at::Tensor();
  b.units = Units{b.units_scale.defined() ? b.units_scale.data_ptr<at::Half>() : nullptr,
                  b.units_offset.defined() ? b.units_offset.data_ptr<at::Half>() : nullptr};
  b.values = values.contiguous();
  b.scale = scale.contiguous();
  b.offset = has_offset ? offset->contiguous() : at::Tensor();
  return b;
}

at::Tensor qmm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scale,
               const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& super_scale,
               const c10::optional<at::Tensor>& super_offset, int64_t bits, int64_t block,
               int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0);
  const Blocks b = blocks_of(values, scale, offset, super_scale, super_offset, bits, block, K);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  thread_local Rounded r;  // the calling thread's, kept between calls
  const float* xp = xc.data_ptr<float>();
  round_rows(xp, M, K, r);
  if (b.two_level) {
    qmm_as<int8_t>(xp, r, b.values, b.scale, b.offset, b.units, bits, block, zero, M, K, out);
  } else if (b.scale.scalar_type() == at::kHalf) {
    qmm_as<at::Half>(xp, r, b.values, b.scale, b.offset, b.units, bits, block, zero, M, K, out);
  } else {
    qmm_as<float>(xp, r, b.values, b.scale, b.offset, b.units, bits, block, zero, M, K, out);
  }
  return out;
}


template <typename S>
void qmm_ids_as(const float* x, const Rounded& r, const int64_t* ids, const at::Tensor& values,
                const at::Tensor& scale, const at::Tensor& offset, const Units& units, int64_t bits,
                int64_t block, int64_t zero, int64_t M, int64_t K, int64_t R, at::Tensor& out) {
  const uint8_t* v = values.data_ptr<uint8_t>();
  const S* s = scale.data_ptr<S>();
  const S* o = offset.defined() ? offset.data_ptr<S>() : nullptr;
  float* y = out.data_ptr<float>();
  const int32_t z = static_cast<int32_t>(zero);
  const bool has_offset = o != nullptr;
#define DIKKAT_RUN(B, L, O) run_ids<B, L, O, S>(r, M, K, R, ids, v, s, o, units, z, y)
  if (bits == 8 && block == 32) { if (has_offset) DIKKAT_RUN(8, 32, true); else DIKKAT_RUN(8, 32, false); }
  else if (bits == 8) { if (has_offset) DIKKAT_RUN(8, 16, true); else DIKKAT_RUN(8, 16, false); }
  else if (bits == 6 && block == 32) { if (has_offset) DIKKAT_RUN(6, 32, true); else DIKKAT_RUN(6, 32, false); }
  else if (bits == 6) { if (has_offset) DIKKAT_RUN(6, 16, true); else DIKKAT_RUN(6, 16, false); }
  else if (block == 32) { if (has_offset) DIKKAT_RUN(4, 32, true); else DIKKAT_RUN(4, 32, false); }
  else { if (has_offset) DIKKAT_RUN(4, 16, true); else DIKKAT_RUN(4, 16, false); }
#undef DIKKAT_RUN
  for (int64_t m = 0; m < M; ++m) {  // a row with a NaN or ±Inf: its terms, over its own block
    if (!r.odd[m]) [[likely]] continue;
    const int64_t n0 = ids[m] * R, row_bytes = K * bits / 8, per_row = K / block;
    const Units at{units.scale ? units.scale + n0 * (K / kSuper) : nullptr,
                   units.offset ? units.offset + n0 * (K / kSuper) : nullptr};
    const Weight<S> w{v + n0 * row_bytes, s + n0 * per_row, o ? o + n0 * per_row : nullptr, at, R, K, bits, block, z};
    add_nonfinite<S>(x + m * K, std::vector<uint8_t>{1}, w, y + m * R);
  }
}

// out[m] = x[m] times rows [ids[m] · rows, ids[m] · rows + rows) of the weight (see run_ids)
at::Tensor qmm_ids(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& values,
                   const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                   const c10::optional<at::Tensor>& super_scale,
                   const c10::optional<at::Tensor>& super_offset, int64_t bits, int64_t block,
                   int64_t zero, int64_t rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0);
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == M && ids.scalar_type() == at::kLong,
              "ids must be (M,) int64, one a row of x");
  TORCH_CHECK(rows > 0 && rows % kRows == 0 && N % rows == 0,
              "rows must be a multiple of 16 that divides the weight's rows");
  const Blocks b = blocks_of(values, scale, offset, super_scale, super_offset, bits, block, K);
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(0 <= id[m] && id[m] < N / rows, "ids must lie in [0, ", N / rows, "), got ", id[m]);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, rows}, x.options());
  if (M == 0) return out;
  thread_local Rounded r;
  const float* xp = xc.data_ptr<float>();
  round_rows(xp, M, K, r);
  const auto& [v, sc, oc, us, uo, units, two_level] = b;
  if (two_level) qmm_ids_as<int8_t>(xp, r, id, v, sc, oc, units, bits, block, zero, M, K, rows, out);
  else if (sc.scalar_type() == at::kHalf) qmm_ids_as<at::Half>(xp, r, id, v, sc, oc, units, bits, block, zero, M, K, rows, out);
  else qmm_ids_as<float>(xp, r, id, v, sc, oc, units, bits, block, zero, M, K, rows, out);
  return out;
}

// A mixture of experts' MLPs for the tokens x (M, C), each through its k picks (experts (M, k),
// weighted by weights (M, k)), the experts stacked as packed blocks: gate_up (E · 2H, C), each
// expert's gate rows then up rows, and down (E · C, H). The (token, pick) pairs are sorted by
// expert, so that an expert's rows read its weights once (qmm_ids), and summed into each token's
// row in the order of their experts: the ATen operations of SparseMoE._stacked, in one call.
at::Tensor qmm_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                       const at::Tensor& gu_values, const at::Tensor& gu_scale,
                       const c10::optional<at::Tensor>& gu_offset,
                       const c10::optional<at::Tensor>& gu_super_scale,
                       const c10::optional<at::Tensor>& gu_super_offset, int64_t gu_bits,
                       int64_t gu_block, int64_t gu_zero, const at::Tensor& down_values,
                       const at::Tensor& down_scale, const c10::optional<at::Tensor>& down_offset,
                       const c10::optional<at::Tensor>& down_super_scale,
                       const c10::optional<at::Tensor>& down_super_offset, int64_t down_bits,
                       int64_t down_block, int64_t down_zero, int64_t hidden, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && weights.dim() == 2 && experts.sizes() == weights.sizes() &&
                  weights.size(0) == x.size(0) && weights.scalar_type() == x.scalar_type(),
              "x must be (M, C), weights and experts (M, k), weights in x's dtype");
  const int64_t k = experts.size(1), C = x.size(1);
  const auto [ids, order] = at::sort(experts.reshape(-1));
  const at::Tensor token = order.div(k, "floor");
  const at::Tensor gu = qmm_ids(x.index_select(0, token), ids, gu_values, gu_scale, gu_offset,
                                gu_super_scale, gu_super_offset, gu_bits, gu_block, gu_zero, 2 * hidden);
  const at::Tensor gate = gu.narrow(1, 0, hidden), up = gu.narrow(1, hidden, hidden);
  const at::Tensor h = (gelu ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(up);
  at::Tensor y = qmm_ids(h, ids, down_values, down_scale, down_offset, down_super_scale,
                         down_super_offset, down_bits, down_block, down_zero, C);
  y.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1));
  return at::zeros_like(x).index_add_(0, token, y);
}

}  // namespace

TORCH_LIBRARY(dikkat_native, m) {
  m.def("qmm(Tensor x, Tensor values, Tensor scale, Tensor? offset, Tensor? super_scale, "
        "Tensor? super_offset, int bits, int block, int zero) -> Tensor");
  m.def("qmm_ids(Tensor x, Tensor ids, Tensor values, Tensor scale, Tensor? offset, "
        "Tensor? super_scale, Tensor? super_offset, int bits, int block, int zero, int rows) -> Tensor");
  m.def("qmm_experts(Tensor x, Tensor weights, Tensor experts, Tensor gu_values, Tensor gu_scale, "
        "Tensor? gu_offset, Tensor? gu_super_scale, Tensor? gu_super_offset, int gu_bits, "
        "int gu_block, int gu_zero, Tensor down_values, Tensor down_scale, Tensor? down_offset, "
        "Tensor? down_super_scale, Tensor? down_super_offset, int down_bits, int down_block, "
        "int down_zero, int hidden, bool gelu) -> Tensor");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) {
  m.impl("qmm", &qmm);
  m.impl("qmm_ids", &qmm_ids);
  m.impl("qmm_experts", &qmm_experts);
}

// which group product this build multiplies with: "vnni", "avx2" or "plain" (for the tests)
extern "C" const char* dikkat_native_qmm_path() { return DIKKAT_VNNI ? "vnni" : DIKKAT_AVX2 ? "avx2" : "plain"; }
