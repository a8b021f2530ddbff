// How the packed weights of qmm.cpp and dequantize.cpp lie in memory, and one value of such a
// weight read back.
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
//
// The product reads the weight in groups of 16 rows (dikkat/layers/packed_groups.py): a group's
// chunk j (32 bytes) holds byte pair j of each of its 16 rows, row r's at 2 r; its scales (and
// offsets) 16 a block, row r's at r; a last N % 16 rows stay row by row. Byte pair j of a row
// holds, for 8 bits, values 2 j and 2 j + 1; for 4 bits (16 bytes a block of 32), the low
// nibbles hold values 2 c, 2 c + 1 and the high ones 2 c + 16, 2 c + 17 of the row's 32-value
// block j / 8, c = j % 8. So an unpacked chunk is 16 lanes of two 16-bit weights, one lane a row,
// and vpdpwssd multiplies it with a broadcast pair of activations. 6 bits (24 bytes a block): 8
// chunks of low nibbles as for 4 bits, then 4 chunks of top bits; top chunk p, widened to 16-bit
// words, holds in bits 0-1, 2-3, 4-5 and 6-7 of its two words the top bits of the values of
// nibble chunk 2 p (low, high nibbles) and 2 p + 1 (low, high nibbles): a shift by 4, 2, 0 or
// -2 and a mask move them above the nibbles.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;   // values a block of 32 (of activations, and most weights)
constexpr int64_t kSuper = 256;  // values a super-block of two-level scales
constexpr int64_t kRows = 16;    // weight rows a group
constexpr int64_t kAhead = 4096;  // bytes of weights asked for ahead of their turn

// the activation rows a group product multiplies (qmm.cpp rounds them): for each, its rounded
// values (K), their block scales d (K / 32), d times a weight block's sum of them (K / BLOCK),
// -zero times that sum, and its output row at the group's first column
template <int TILE>
struct Tile {
  const int16_t* aq[TILE];
  const float* ad[TILE];
  const float* da[TILE];
  const int32_t* zs[TILE];
  float* out[TILE];
};

// a two-level format's fp16 super-block scales (and offsets): (N, K / 256), as the int8 ones
struct Units {
  const at::Half* scale = nullptr;
  const at::Half* offset = nullptr;
};

// Scales and offsets are fp32, or fp16 where a file's fp16 values are kept as they are.
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// the integer q of value k of a row whose byte b is at(b)
template <int BITS, typename At>
inline int32_t value_at(const At& at, int64_t k) {
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

// the integer q of value k (of K) of row r, in a group's bytes (the scalar paths and the tail)
template <int BITS>
inline int32_t group_value(const uint8_t* group, int64_t r, int64_t k) {
  return value_at<BITS>([&](int64_t b) { return group[(b / 2) * 32 + 2 * r + b % 2]; }, k);
}

// a block's scale (or offset) in fp32: element i of a plain one, or for two levels element i
// of the int8 ones times element u of the fp16 super-block ones
template <typename S>
inline float scale_at(const S* s, const at::Half*, int64_t i, int64_t) { return to_float(s[i]); }
inline float scale_at(const int8_t* s, const at::Half* unit, int64_t i, int64_t u) {
  return static_cast<float>(s[i]) * static_cast<float>(unit[u]);
}

// where element (n, x) of a matrix (N, X) lies in its grouped layout, units of `unit` elements
// interleaved: unit j of a group's row r at unit 16 j + r; the last N % 16 rows as rows
inline int64_t grouped_index(int64_t n, int64_t x, int64_t N, int64_t X, int64_t unit) {
  if (n >= N / kRows * kRows) return n * X + x;
  return (n / kRows) * kRows * X + (x / unit) * kRows * unit + (n % kRows) * unit + x % unit;
}

// a grouped weight (N, K), read one value at a time: value (n, k) in fp32, as the dequantised
// weight holds it (the dequantize op's arithmetic)
template <typename S>
struct Weight {
  const uint8_t* values;
  const S* scale;
  const S* offset;  // or nullptr
  Units units;
  int64_t N, K, bits, block;
  int32_t zero;

  float at(int64_t n, int64_t k) const {
    const int64_t row_bytes = K * bits / 8, per_row = K / block, unit_row = K / kSuper;
    const auto byte = [&](int64_t b) { return values[grouped_index(n, b, N, row_bytes, 2)]; };
    const int32_t q = bits == 8 ? value_at<8>(byte, k) : bits == 6 ? value_at<6>(byte, k) : value_at<4>(byte, k);
    const int64_t i = grouped_index(n, k / block, N, per_row, 1);
    const int64_t u = unit_row > 0 ? grouped_index(n, k / kSuper, N, unit_row, 1) : 0;
    const float s = scale_at(scale, units.scale, i, u);
    if (offset != nullptr) return s * static_cast<float>(q) + scale_at(offset, units.offset, i, u);
    return s * (static_cast<float>(q) - static_cast<float>(zero));
  }
};

// checks shared by qmm and dequantize: values (N, K · bits / 8) uint8, scale (N, K / block)
// fp32 or fp16 (or int8: see qmm.cpp's check_units), offset absent or shaped and typed as scale
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

}  // namespace
