// The weight (N, K) that packed blocks stand for, in fp32, row by row (qmm_layout.h says how the
// blocks lie): a prefill multiplies it with oneDNN. A NaN or ±Inf scale or offset gives what IEEE
// arithmetic gives for its block's values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "qmm_layout.h"

namespace {

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(dikkat_native, m) {
  m.def("dequantize(Tensor values, Tensor scale, Tensor? offset, int bits, int block, int zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) { m.impl("dequantize", &dequantize); }
