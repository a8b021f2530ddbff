// The product of a tile of rounded activation rows with one group of 16 packed weight rows, in
// AVX-512 VNNI: a chunk of a group (qmm_layout.h) unpacks to 16 lanes of two 16-bit weights, one
// lane a weight row, and vpdpwssd multiplies it with a broadcast pair of activations into 32-bit
// sums (Intel's intrinsics guide: _mm512_dpwssd_epi32).
#pragma once

#include <immintrin.h>

#include "qmm_layout.h"

namespace {

inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const at::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// a.out[t][lane] for the tile's rows t and the group's rows (lanes < rows). The weights ahead
// are asked for into L1, or with TO_L2 into L2 only: where one tile alone reads a group of
// 6-bit weights (a decode step's rows), a core streaming them from memory then keeps more of
// them on the way (BENCHMARKS.md, "Prefetching into L2"; the other widths were no faster so).
template <int BITS, int BLOCK, bool OFFSET, int TILE, bool TO_L2, typename S>
void group_vnni(const Tile<TILE>& a, int64_t G, const uint8_t* group, const S* scale,
                const S* offset, int64_t rows) {
  const auto& [aq, ad, da, zs, out] = a;
  constexpr int64_t chunk_bytes = kRows * 2, group_bytes = kRows * kGroup * BITS / 8;
  __m512 acc[TILE];
  // every loop over the tile's rows unrolled, so that the accumulators stay in registers
  #pragma GCC unroll 8
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = group + g * group_bytes;
    for (int64_t b = 0; b < group_bytes; b += 64) {
      const char* ahead = reinterpret_cast<const char*>(c + kAhead + b);
      if constexpr (TO_L2) _mm_prefetch(ahead, _MM_HINT_T1);
      else _mm_prefetch(ahead, _MM_HINT_T0);
    }
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
  for (int t = 0; t < TILE; ++t) _mm512_mask_storeu_ps(out[t], lanes, acc[t]);
}

}  // namespace
