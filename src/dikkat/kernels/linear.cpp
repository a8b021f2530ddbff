// Products of activation rows with a weight held in fp32, fp16 or bf16: decoding's x Wᵀ + b.
//
// x (M, K) fp32, w (N, K) fp32, fp16 or bf16, bias (N) fp32 or none → (M, N) fp32, every row of
// x and w contiguous; a 16-bit weight is widened to fp32 as it is read (exactly: every fp16 and
// bf16 value is an fp32 value) and the arithmetic is fp32's. Decoding one sequence multiplies
// one row by every weight matrix of the model, so a step is as fast as the weights are read from
// memory. Each thread takes a contiguous span of w's rows and, in AVX-512, reads one row after
// another, 64 values a step in four sums of 16 lanes (one_row): one stream through memory, which
// the hardware prefetchers follow and a software prefetch into L2 runs ahead of; in AVX2 four
// rows side by side, 16 values of each a step, 16 partial sums each (two registers of 8 lanes;
// rows_times). The partial sums are added in a tree
// at the end. It is made for one row: further rows of x are each multiplied with the rows of w
// from cache, one after the other, which is slower than a matrix product's kernel from two rows
// on (benchmarks/decode_parts.py). So from
// kBlasRows rows on (a prompt's prefill, a batch) a 16-bit weight is widened a slice of rows at
// a time and multiplied by oneDNN's fp32 product (ATen's where PyTorch has no oneDNN); an fp32
// weight's caller chooses that product itself (dikkat.weights.dense.Fp32Linear).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;                // weight rows read together
constexpr int64_t kChunkBytes = 65536;      // at least this much of w a thread's span
constexpr int64_t kBlasRows = 8;            // from this many rows of x, a 16-bit w is widened
constexpr int64_t kWidenedBytes = 8 << 20;  // fp32 bytes of w widened at a time for that
// In AVX-512, one_row asks for the weights this many bytes ahead of their turn, into L2: a core
// streaming a matrix from memory then keeps more of it on the way than its prefetchers alone
// do (into L1 it was slower: BENCHMARKS.md, "Prefetching into L2")
constexpr int64_t kAhead = 4096;

template <typename W>
struct Product {
  const float* x;
  int64_t x_stride, M, K;
  const W* w;
  int64_t w_stride;
  const float* bias;  // or nullptr
  float* out;
  int64_t out_stride, N;
};

#if defined(__AVX512F__)
// 16 values of a weight row as fp32 lanes; the masked form reads only the lanes set
inline __m512 lanes16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 lanes16(const c10::Half* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline __m512 lanes16(const c10::BFloat16* w) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// the last n < 16 values of a row, zeros after them
template <typename W>
inline __m512 tail16(const W* w, int64_t n) {
  W v[16] = {};
  std::copy(w, w + n, v);
  return lanes16(v);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 8 values of a weight row as fp32 lanes
inline __m256 lanes8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 lanes8(const c10::Half* w) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
#else
  alignas(32) float v[8];
  for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(w[j]);
  return _mm256_load_ps(v);
#endif
}
inline __m256 lanes8(const c10::BFloat16* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// out[m, n .. n + R) for every row m of x: R rows of w from row n, read from memory for the
// first row of x and from cache for the others (without AVX-512; with it, one_row)
template <int R, typename W>
void rows_times(const Product<W>& p, int64_t n) {
  const W* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (n + r) * p.w_stride;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.x_stride;
    float sums[R];
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    __m256 a[R], b[R];  // values k % 16 < 8 and ≥ 8 of each row: 16 partial sums
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= p.K; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_fmadd_ps(lanes8(w[r] + k), x0, a[r]);
        b[r] = _mm256_fmadd_ps(lanes8(w[r] + k + 8), x1, b[r]);
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      alignas(32) float part[8];
      _mm256_store_ps(part, _mm256_add_ps(a[r], b[r]));
      float s = 0.f;
      for (int64_t j = k; j < p.K; ++j) s += static_cast<float>(w[r][j]) * x[j];  // the last K % 16
      for (int j = 0; j < 8; ++j) s += part[j];
      sums[r] = s;
    }
#else
    for (int r = 0; r < R; ++r) {  // 16 partial sums, as the vector path keeps them
      float part[16] = {};
      for (int64_t k = 0; k < p.K; ++k) part[k % 16] += static_cast<float>(w[r][k]) * x[k];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += part[j];
      sums[r] = s;
    }
#endif
    float* o = p.out + m * p.out_stride + n;
    for (int r = 0; r < R; ++r) o[r] = p.bias ? sums[r] + p.bias[n + r] : sums[r];
  }
}

#if defined(__AVX512F__)
// out[m, n] for every row m of x: row n of w alone, 64 values a step in four sums of 16 lanes.
// Rows read one after another are one stream through memory: faster than four rows side by side
// for 16-bit weights, and for fp32 ones lying in a file's map (BENCHMARKS.md, "16-bit files" and
// "Weights where the file lies")
template <typename W>
void one_row(const Product<W>& p, int64_t n) {
  const W* w = p.w + n * p.w_stride;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.x_stride;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 64 <= p.K; k += 64) {
      if (m == 0) {  // the weights kAhead bytes on, into L2 (see kAhead)
        const char* ahead = reinterpret_cast<const char*>(w + k) + kAhead;
        for (int64_t b = 0; b < 64 * int64_t(sizeof(W)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
      }
      a0 = _mm512_fmadd_ps(lanes16(w + k), _mm512_loadu_ps(x + k), a0);
      a1 = _mm512_fmadd_ps(lanes16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
      a2 = _mm512_fmadd_ps(lanes16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
      a3 = _mm512_fmadd_ps(lanes16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k < p.K; k += 16) {  // the last K % 64 values, 16 at a time
      const int64_t r = std::min<int64_t>(16, p.K - k);
      const __m512 x0 = _mm512_maskz_loadu_ps(r == 16 ? 0xFFFF : (1u << r) - 1, x + k);
      a0 = _mm512_fmadd_ps(tail16(w + k, r), x0, a0);
    }
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    p.out[m * p.out_stride + n] = p.bias ? s + p.bias[n] : s;
  }
}
#endif

template <typename W>
void by_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const Product<W> p{x.data_ptr<float>(), x.stride(0), M, K, w.data_ptr<W>(), w.stride(0),
                     bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0), N};
#if defined(__AVX512F__)
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (K * int64_t(sizeof(W))));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) one_row<W>(p, n);
  });
#else
  const int64_t groups = N / kRows;
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (kRows * K * int64_t(sizeof(W))));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) rows_times<kRows>(p, g * kRows);
  });
  for (int64_t n = groups * kRows; n < N; ++n) rows_times<1>(p, n);
#endif
}

// oneDNN's fp32 product (the op dikkat.weights.dense.Fp32Linear uses), or nothing in a PyTorch
// built without oneDNN: on a weight in ATen's plain layout it was measured faster than ATen's
// matrix product for a prompt's rows (BENCHMARKS.md, "Weights where the file lies")
const std::optional<c10::OperatorHandle>& onednn_linear() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op;
}

// x wᵀ + bias by oneDNN, called boxed (its C++ signature is PyTorch's own business)
at::Tensor by_onednn(const c10::OperatorHandle& op, const at::Tensor& x, const at::Tensor& w,
                     const at::Tensor& bias) {
  torch::jit::Stack stack{x, w, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// many rows of x times a 16-bit w: w widened to fp32 a slice of rows at a time (a few MB, not a
// copy of the whole weight), each slice multiplied by oneDNN (then copied into its columns of
// out) or else by ATen's matrix product (straight into them: BLAS writes a block in place)
void by_widened_slices(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out) {
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t slice = std::max<int64_t>(16, kWidenedBytes / (4 * K));
  const auto& onednn = onednn_linear();
  for (int64_t n = 0; n < N; n += slice) {
    const int64_t rows = std::min(slice, N - n);
    const at::Tensor wide = w.narrow(0, n, rows).to(at::kFloat);
    const at::Tensor b = bias.defined() ? bias.narrow(0, n, rows) : at::Tensor();
    at::Tensor part = out.narrow(1, n, rows);
    if (onednn) {
      part.copy_(by_onednn(*onednn, x, wide, b));
    } else if (b.defined()) {
      at::addmm_out(part, b, x, wide.t());
    } else {
      at::mm_out(part, x, wide.t());
    }
  }
}

void check_operands(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const auto kind = w.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  TORCH_CHECK(w.dim() == 2 && (kind == at::kFloat || kind == at::kHalf || kind == at::kBFloat16),
              "w must be (N, K) fp32, fp16 or bf16");
  TORCH_CHECK(w.size(1) == x.size(1), "x (M, K) and w (N, K) must share K");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == w.size(0) && bias->scalar_type() == at::kFloat),
              "bias must be (N,) fp32");
}

// x wᵀ + bias written into out (M, N), whose rows may be a block of a wider matrix's rows
void product_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = w.stride(1) == 1 ? w : w.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const auto kind = w.scalar_type();
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (bias) out.copy_(bc.expand({M, N})); else out.zero_();
    return;
  }
  if (kind == at::kFloat) {
    by_rows<float>(xc, wc, bc, out);
  } else if (M >= kBlasRows) {
    by_widened_slices(xc, wc, bc, out);
  } else if (kind == at::kHalf) {
    by_rows<c10::Half>(xc, wc, bc, out);
  } else {
    by_rows<c10::BFloat16>(xc, wc, bc, out);
  }
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_operands(x, w, bias);
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  product_into(x, w, bias, out);
  return out;
}

void linear_rows_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      at::Tensor out) {
  check_operands(x, w, bias);
  const int64_t M = x.size(0), N = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat &&
                  (N <= 1 || out.stride(1) == 1) && (M <= 1 || out.stride(0) >= N),
              "out must be (M, N) fp32, each row contiguous");
  product_into(x, w, bias, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dikkat_native, m) {
  m.def("linear_rows(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_rows_into(Tensor x, Tensor w, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(dikkat_native, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_into", &linear_rows_into);
}
