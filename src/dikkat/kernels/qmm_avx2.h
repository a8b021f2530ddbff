// The product of a tile of rounded activation rows with one group of 16 packed weight rows, in
// AVX2: the group_vnni of qmm_vnni.h on 256-bit registers. A register holds 8 lanes of two
// 16-bit weights, so a group is taken as two halves of 8 rows (bytes 16 h … 16 h + 15 of every
// 32-byte chunk), and vpmaddwd multiplies a half's lanes with a broadcast pair of activations
// into 32-bit sums that are then added (Intel's intrinsics guide: _mm256_madd_epi16). Its
// arithmetic is group_vnni's, operation for operation, so the two builds give the same floats.
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "qmm_layout.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 16 bytes (8 rows' byte pair) widened to 16-bit words
inline __m256i widen(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// a.out[t][8 h + lane] for the tile's rows t and the group's rows 8 h … 8 h + 7 (those < rows)
template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void half_avx2(const Tile<TILE>& a, int64_t G, const uint8_t* group, const S* scale,
               const S* offset, int64_t h, int64_t rows) {
  const auto& [aq, ad, da, zs, out] = a;
  constexpr int64_t chunk_bytes = kRows * 2, group_bytes = kRows * kGroup * BITS / 8;
  const int64_t lane0 = 8 * h;
  __m256 acc[TILE];
  #pragma GCC unroll 8
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = group + g * group_bytes + 16 * h;
    if (h == 0) {
      for (int64_t b = 0; b < group_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(c + kAhead + b), _MM_HINT_T0);
    }
    // h0: values 0-15 of the block of 32, h1: values 16-31, started at -zero times the
    // activations' sum where the format is symmetric
    __m256i h0[TILE], h1[TILE];
    #pragma GCC unroll 8
    for (int t = 0; t < TILE; ++t) {
      if constexpr (OFFSET) {
        h0[t] = h1[t] = _mm256_setzero_si256();
      } else if constexpr (BLOCK == 32) {
        h0[t] = _mm256_set1_epi32(zs[t][g]);
        h1[t] = _mm256_setzero_si256();
      } else {
        h0[t] = _mm256_set1_epi32(zs[t][2 * g]);
        h1[t] = _mm256_set1_epi32(zs[t][2 * g + 1]);
      }
    }
    #pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) {
      __m256i w0, w1;  // pairs j (values 2 j, 2 j + 1) and j + 8 (values 2 j + 16, 2 j + 17)
      if constexpr (BITS == 4 || BITS == 6) {
        const __m256i w = widen(c + j * chunk_bytes);
        w0 = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
        w1 = _mm256_srli_epi16(w, 4);
        if constexpr (BITS == 6) {  // w | (top & 0x30), the top bits of nibble chunk j moved
          const __m256i top = widen(c + (8 + j / 2) * chunk_bytes);
          const __m256i bits45 = _mm256_set1_epi16(0x30);
          const __m256i t0 = j % 2 ? top : _mm256_slli_epi16(top, 4);
          const __m256i t1 = j % 2 ? _mm256_srli_epi16(top, 2) : _mm256_slli_epi16(top, 2);
          w0 = _mm256_or_si256(w0, _mm256_and_si256(t0, bits45));
          w1 = _mm256_or_si256(w1, _mm256_and_si256(t1, bits45));
        }
      } else {
        w0 = widen(c + j * chunk_bytes);
        w1 = widen(c + (j + 8) * chunk_bytes);
      }
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const int16_t* x = aq[t] + g * kGroup + 2 * j;
        const __m256i x0 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x));
        const __m256i x1 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + 16));
        h0[t] = _mm256_add_epi32(h0[t], _mm256_madd_epi16(w0, x0));
        h1[t] = _mm256_add_epi32(h1[t], _mm256_madd_epi16(w1, x1));
      }
    }
    if constexpr (BLOCK == 32) {
      const __m256 s = load8(scale + g * kRows + lane0);
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(ad[t][g]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(h0[t], h1[t])), sd, acc[t]);
        if constexpr (OFFSET) {
          acc[t] = _mm256_fmadd_ps(load8(offset + g * kRows + lane0), _mm256_set1_ps(da[t][g]), acc[t]);
        }
      }
    } else {
      const __m256 s0 = load8(scale + 2 * g * kRows + lane0);
      const __m256 s1 = load8(scale + (2 * g + 1) * kRows + lane0);
      #pragma GCC unroll 8
      for (int t = 0; t < TILE; ++t) {
        const __m256 d = _mm256_set1_ps(ad[t][g]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0[t]), _mm256_mul_ps(s0, d), acc[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1[t]), _mm256_mul_ps(s1, d), acc[t]);
        if constexpr (OFFSET) {
          acc[t] = _mm256_fmadd_ps(load8(offset + 2 * g * kRows + lane0), _mm256_set1_ps(da[t][2 * g]), acc[t]);
          acc[t] = _mm256_fmadd_ps(load8(offset + (2 * g + 1) * kRows + lane0), _mm256_set1_ps(da[t][2 * g + 1]), acc[t]);
        }
      }
    }
  }
  const int64_t kept = std::min<int64_t>(8, rows - lane0);
  #pragma GCC unroll 8
  for (int t = 0; t < TILE; ++t) {
    if (kept == 8) {
      _mm256_storeu_ps(out[t] + lane0, acc[t]);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[t]);
      std::copy(lanes, lanes + kept, out[t] + lane0);
    }
  }
}

template <int BITS, int BLOCK, bool OFFSET, int TILE, typename S>
void group_avx2(const Tile<TILE>& a, int64_t G, const uint8_t* group, const S* scale,
                const S* offset, int64_t rows) {
  half_avx2<BITS, BLOCK, OFFSET, TILE, S>(a, G, group, scale, offset, 0, rows);
  if (rows > 8) half_avx2<BITS, BLOCK, OFFSET, TILE, S>(a, G, group, scale, offset, 1, rows);
}

}  // namespace
