// Attention of one new query a head over keys and values kept in a pool of slots (a paged KV
// cache): the decode step of a batch whose rows sit at positions of their own.
//
// q (B, H, D); k, v (N, G, D), slot n holding one token's keys and values, read in place with
// their strides over N and G (a static cache (1, G, S, D), transposed to (S, G, D), is such a
// pool); slots (B, S): row b's token j sits at slot slots[b, j]; positions (B,): row b's new
// query is its token positions[b], and it attends its tokens lo … positions[b], lo = 0, or
// positions[b] - window + 1 in a sliding layer (window > 0). Head h reads key head h / (H / G)
// (grouped queries). The result is
//   out[b, h] = sum_j softmax_j(scale · q[b, h] · k[slot_j]) v[slot_j],
// the softmax taken as max, exp, sum, in fp32, per row and head.
//
// Written for what a compiled graph makes of it otherwise: for one query a head, a gather of
// each row's slots, then either many small matrix products or loops that gather element by
// element. Here each (row, key head) reads its slots' keys once for the H / G heads that share
// them, then their values once, in order, the next slot's row asked for ahead of its turn.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// q · k over D values: 16 partial sums (one AVX-512 register where there is one), added in a
// tree at the end
inline float dot(const float* q, const float* k, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  __m512 part = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    part = _mm512_add_ps(part, _mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d)));
  }
  float total = _mm512_reduce_add_ps(part);
#else
  float part[16] = {};
  for (; d + 16 <= D; d += 16) {
    for (int64_t l = 0; l < 16; ++l) part[l] += q[d + l] * k[d + l];
  }
  for (int64_t half = 8; half > 0; half /= 2) {
    for (int64_t l = 0; l < half; ++l) part[l] += part[l + half];
  }
  float total = part[0];
#endif
  for (; d < D; ++d) total += q[d] * k[d];
  return total;
}

// o += w · v over D values
inline void add_scaled(float* __restrict o, float w, const float* __restrict v, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 ws = _mm512_set1_ps(w);
  for (; d + 16 <= D; d += 16) {
    const __m512 scaled = _mm512_mul_ps(ws, _mm512_loadu_ps(v + d));
    _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_loadu_ps(o + d), scaled));
  }
#endif
  for (; d < D; ++d) o[d] += w * v[d];
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& slots, const at::Tensor& positions, int64_t window,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be (B, H, D) fp32");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && v.sizes() == k.sizes() &&
                  v.scalar_type() == at::kFloat,
              "k and v must be (N, G, D) fp32, alike");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = k.size(0), G = k.size(1);
  TORCH_CHECK(k.size(2) == D, "k's head dim must be q's");
  TORCH_CHECK(G > 0 && H % G == 0, "the key heads must divide the query heads");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && slots.scalar_type() == at::kLong,
              "slots must be (B, S) int64");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == B &&
                  positions.scalar_type() == at::kLong,
              "positions must be (B,) int64");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a number of positions");
  const int64_t S = slots.size(1), R = H / G;
  // a head's D values are read as one run; the slots and heads may lie anywhere
  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = k.stride(2) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(2) == 1 ? v : v.contiguous();
  const int64_t ks = kc.stride(0), kh = kc.stride(1), vs = vc.stride(0), vh = vc.stride(1);
  const at::Tensor sc = slots.contiguous(), pc = positions.contiguous();
  const int64_t* slot = sc.data_ptr<int64_t>();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < S, "positions must lie in 0 … S - 1");
    for (int64_t j = 0; j <= pos[b]; ++j) {
      TORCH_CHECK(slot[b * S + j] >= 0 && slot[b * S + j] < N, "slots must lie in 0 … N - 1");
    }
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc_f = static_cast<float>(scale);
  at::parallel_for(0, B * G, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> w;  // (R, columns): the scores, then the weights
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / G, g = t % G;
      const int64_t hi = pos[b], lo = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
      const int64_t n = hi - lo + 1;
      const int64_t* row = slot + b * S + lo;
      w.resize(R * n);
      const float* qg = qp + (b * H + g * R) * D;
      for (int64_t j = 0; j < n; ++j) {
        if (j + 1 < n) __builtin_prefetch(kp + row[j + 1] * ks + g * kh);
        const float* kj = kp + row[j] * ks + g * kh;
        for (int64_t r = 0; r < R; ++r) w[r * n + j] = sc_f * dot(qg + r * D, kj, D);
      }
      for (int64_t r = 0; r < R; ++r) {
        float* wr = w.data() + r * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) top = std::max(top, wr[j]);
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          wr[j] = std::exp(wr[j] - top);
          total += wr[j];
        }
        for (int64_t j = 0; j < n; ++j) wr[j] /= total;
      }
      float* og = op + (b * H + g * R) * D;
      std::fill(og, og + R * D, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        if (j + 1 < n) __builtin_prefetch(vp + row[j + 1] * vs + g * vh);
        const float* vj = vp + row[j] * vs + g * vh;
        for (int64_t r = 0; r < R; ++r) add_scaled(og + r * D, w[r * n + j], vj, D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dikkat_native, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor positions, "
        "int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) { m.impl("paged_attention", &paged_attention); }
