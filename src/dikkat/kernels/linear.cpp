// fp32 products of an activation row with an fp32 weight: decoding's x Wᵀ + b.
//
// x (M, K), w (N, K), bias (N) or none → (M, N), every row of x and w contiguous. Decoding one
// sequence multiplies one row by every weight matrix of the model, so a step is as fast as the
// weights are read from memory. Each thread takes a contiguous span of w's rows and reads four
// rows at a time, 32 values of each per step: eight 64-byte loads from four streams in flight,
// which the hardware prefetchers follow. Each output is a sum of 32 fp32 partial sums (two
// registers of 16 lanes), added in a tree at the end; in AVX2, 16 values a step and 16 partial
// sums (two registers of 8 lanes). It is made for one row: further rows
// of x are each multiplied with the four rows of w from cache, one after the other, which is
// slower than a matrix product's kernel from two rows on (benchmarks/decode_parts.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;            // weight rows read together
constexpr int64_t kChunkBytes = 65536;  // at least this much of w a thread's span

struct Product {
  const float* x;
  int64_t x_stride, M, K;
  const float* w;
  int64_t w_stride;
  const float* bias;  // or nullptr
  float* out;
  int64_t N;
};

// out[m, n .. n + R) for every row m of x: R rows of w from row n, read from memory for the
// first row of x and from cache for the others
template <int R>
void rows_times(const Product& p, int64_t n) {
  const float* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (n + r) * p.w_stride;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.x_stride;
    float sums[R];
#if defined(__AVX512F__)
    __m512 a[R], b[R];  // values k % 32 < 16 and ≥ 16 of each row
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= p.K; k += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r] + k), x0, a[r]);
        b[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r] + k + 16), x1, b[r]);
      }
    }
    for (; k < p.K; k += 16) {  // the last K % 32 values, 16 at a time, masked
      const __mmask16 lanes = p.K - k >= 16 ? 0xFFFF : (1u << (p.K - k)) - 1;
      const __m512 x0 = _mm512_maskz_loadu_ps(lanes, x + k);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, w[r] + k), x0, a[r]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r], b[r]));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[R], b[R];  // values k % 16 < 8 and ≥ 8 of each row: 16 partial sums
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= p.K; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r] + k), x0, a[r]);
        b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r] + k + 8), x1, b[r]);
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      alignas(32) float part[8];
      _mm256_store_ps(part, _mm256_add_ps(a[r], b[r]));
      float s = 0.f;
      for (int64_t j = k; j < p.K; ++j) s += w[r][j] * x[j];  // the last K % 16 values
      for (int j = 0; j < 8; ++j) s += part[j];
      sums[r] = s;
    }
#else
    for (int r = 0; r < R; ++r) {  // 16 partial sums, as the vector path keeps them
      float part[16] = {};
      for (int64_t k = 0; k < p.K; ++k) part[k % 16] += w[r][k] * x[k];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += part[j];
      sums[r] = s;
    }
#endif
    float* o = p.out + m * p.N + n;
    for (int r = 0; r < R; ++r) o[r] = p.bias ? sums[r] + p.bias[n + r] : sums[r];
  }
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w must be (N, K) fp32");
  TORCH_CHECK(w.size(1) == x.size(1), "x (M, K) and w (N, K) must share K");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == w.size(0) && bias->scalar_type() == at::kFloat),
              "bias must be (N,) fp32");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = w.stride(1) == 1 ? w : w.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias ? out.copy_(bc.expand({M, N})) : out.zero_();
  const Product p{xc.data_ptr<float>(), xc.stride(0), M, K, wc.data_ptr<float>(), wc.stride(0),
                  bias ? bc.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
  const int64_t groups = N / kRows;
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (kRows * K * 4));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) rows_times<kRows>(p, g * kRows);
  });
  for (int64_t n = groups * kRows; n < N; ++n) rows_times<1>(p, n);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dikkat_native, m) {
  m.def("linear_rows(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) { m.impl("linear_rows", &linear_rows); }
