// Greedy decoding's pick: the index of each row's largest value, by torch.argmax's rule: the
// first of equal values, and a NaN counts as larger than any number (its first one is taken).
//
// x (B, V) fp32 → (B,) int64. PyTorch's CPU argmax walks a row one value at a time, carrying the
// index; here a row is read twice, 16 values at a time (8 in AVX2): once for its largest value
// (and whether it holds a NaN), once for the first place that value sits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// the first index i < n with p[i] != p[i] (a NaN), or -1
int64_t first_nan(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] != p[i]) return i;
  }
  return -1;
}

int64_t row_argmax(const float* p, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(top);
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, v);
  }
  top = _mm512_reduce_max_ps(tops);
  nan = nans != 0;
#elif defined(__AVX2__)
  __m256 tops = _mm256_set1_ps(top), nans = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    tops = _mm256_max_ps(tops, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, tops);
  for (const float t : lanes) top = t > top ? t : top;
  nan = _mm256_movemask_ps(nans) != 0;
#endif
  for (; i < n; ++i) {
    nan |= p[i] != p[i];
    top = p[i] > top ? p[i] : top;
  }
  if (nan) return first_nan(p, n);
  i = 0;
#if defined(__AVX512F__)
  const __m512 wanted = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), wanted, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 wanted = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), wanted, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    if (p[i] == top) return i;
  }
  return 0;  // unreachable: top is one of the values
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (B, V) fp32");
  TORCH_CHECK(x.size(1) > 0, "x's rows must not be empty");
  const at::Tensor xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* p = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) o[b] = row_argmax(p + b * V, V);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dikkat_native, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
