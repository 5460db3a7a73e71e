// Fused mixed-precision AdamW over one flat shard on the CPU: one pass reads grad, master,
// m, v and writes master, m, v and (optionally) the 16-bit param copy. OpenMP splits the
// shard into contiguous per-thread ranges; inside a range AVX2 processes 8 lanes with
// 16-bit values converted in registers. The per-element formula is in kernels.h.
#include <omp.h>

#include <algorithm>
#include <stdexcept>

#include "cpu_vec.h"
#include "kernels.h"

namespace zk {
namespace {

// Below this many elements threads cost more than they save.
constexpr int64_t kParallelMin = 1 << 15;

template <typename G, typename LP>
inline void adam_scalar(float* p, const G* g, float* m, float* v, LP* lp, int64_t i,
                        const AdamScalars& s, bool lerp_low) {
  float gi = Scalar<G>::load(g + i) * s.inv_grad_scale;
  float pi = p[i] * s.decay;
  float mi = m[i];
  float d = gi - mi;
  mi = lerp_low ? std::fma(s.one_minus_beta1, d, mi) : std::fma(-d, 1.0f - s.one_minus_beta1, gi);
  // Same roundings as the AVX2 body (and the CUDA kernel): fma where it uses one.
  float vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);
  float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
  pi = std::fma(-s.step_size, mi / denom, pi);
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  if constexpr (!std::is_same_v<LP, void>) Scalar<LP>::store(lp + i, pi);
}

// LERP_LOW is a template parameter so the inner loops carry no branch on it.
template <typename G, typename LP, bool LERP_LOW>
void adam_range(float* p, const G* g, float* m, float* v, LP* lp, int64_t begin, int64_t end,
                const AdamScalars& s) {
  constexpr bool lerp_low = LERP_LOW;
  int64_t i = begin;
#ifdef ZK_AVX512
  {
    const __m512 inv_scale = _mm512_set1_ps(s.inv_grad_scale);
    const __m512 decay = _mm512_set1_ps(s.decay);
    const __m512 w = _mm512_set1_ps(s.one_minus_beta1);
    const __m512 one_minus_w = _mm512_set1_ps(1.0f - s.one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(s.beta2);
    const __m512 omb2 = _mm512_set1_ps(s.one_minus_beta2);
    const __m512 bc2 = _mm512_set1_ps(s.bc2_sqrt);
    const __m512 eps = _mm512_set1_ps(s.eps);
    const __m512 step = _mm512_set1_ps(s.step_size);
    for (; i + 16 <= end; i += 16) {
      __m512 gi = _mm512_mul_ps(Vec16<G>::load(g + i), inv_scale);
      __m512 pi = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
      __m512 mi = _mm512_loadu_ps(m + i);
      __m512 d = _mm512_sub_ps(gi, mi);
      mi = lerp_low ? _mm512_fmadd_ps(w, d, mi) : _mm512_fnmadd_ps(d, one_minus_w, gi);
      __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i), b2);
      vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gi), gi, vi);
      __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
      pi = _mm512_fnmadd_ps(step, _mm512_div_ps(mi, denom), pi);
      _mm512_storeu_ps(p + i, pi);
      _mm512_storeu_ps(m + i, mi);
      _mm512_storeu_ps(v + i, vi);
      if constexpr (!std::is_same_v<LP, void>) Vec16<LP>::store(lp + i, pi);
    }
  }
#endif
#ifdef ZK_AVX2
  const __m256 inv_scale = _mm256_set1_ps(s.inv_grad_scale);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 w = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 one_minus_w = _mm256_set1_ps(1.0f - s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2);
  const __m256 omb2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 bc2 = _mm256_set1_ps(s.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps);
  const __m256 step = _mm256_set1_ps(s.step_size);
  for (; i + 8 <= end; i += 8) {
    __m256 gi = _mm256_mul_ps(Vec8<G>::load(g + i), inv_scale);
    __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    __m256 mi = _mm256_loadu_ps(m + i);
    __m256 d = _mm256_sub_ps(gi, mi);
    mi = lerp_low ? _mm256_fmadd_ps(w, d, mi) : _mm256_fnmadd_ps(d, one_minus_w, gi);
    __m256 vi = _mm256_mul_ps(_mm256_loadu_ps(v + i), b2);
    vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, vi);
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    pi = _mm256_fnmadd_ps(step, _mm256_div_ps(mi, denom), pi);
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if constexpr (!std::is_same_v<LP, void>) Vec8<LP>::store(lp + i, pi);
  }
#endif
  for (; i < end; ++i) adam_scalar<G, LP>(p, g, m, v, lp, i, s, lerp_low);
}

template <typename G, typename LP>
void adam_launch(float* p, const void* g, float* m, float* v, void* lp, int64_t n,
                 const AdamScalars& s) {
  const G* gt = static_cast<const G*>(g);
  LP* lpt = static_cast<LP*>(lp);
  auto range = s.one_minus_beta1 < 0.5f ? &adam_range<G, LP, true> : &adam_range<G, LP, false>;
  if (n < kParallelMin) {
    range(p, gt, m, v, lpt, 0, n, s);
    return;
  }
#pragma omp parallel
  {
    // Contiguous ranges, rounded to 64 elements (a cache line of fp32) so no two threads
    // write the same line.
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((n + nt - 1) / nt + 63) / 64 * 64;
    const int64_t b = std::min(n, t * per), e = std::min(n, b + per);
    range(p, gt, m, v, lpt, b, e, s);
  }
}

template <typename G>
void adam_dispatch_lp(float* p, const void* g, float* m, float* v, void* lp, DType lpdt,
                      int64_t n, const AdamScalars& s) {
  if (lp == nullptr) return adam_launch<G, void>(p, g, m, v, lp, n, s);
  switch (lpdt) {
    case DType::BF16: return adam_launch<G, BF16>(p, g, m, v, lp, n, s);
    case DType::F16: return adam_launch<G, F16>(p, g, m, v, lp, n, s);
    default: throw std::invalid_argument("adamw_cpu: param_lp must be bf16 or fp16");
  }
}

}  // namespace

void adamw_cpu(float* param, const void* grad, DType gdt, float* exp_avg, float* exp_avg_sq,
               void* param_lp, DType lpdt, int64_t n, const AdamScalars& s) {
  switch (gdt) {
    case DType::F32:
      return adam_dispatch_lp<float>(param, grad, exp_avg, exp_avg_sq, param_lp, lpdt, n, s);
    case DType::BF16:
      return adam_dispatch_lp<BF16>(param, grad, exp_avg, exp_avg_sq, param_lp, lpdt, n, s);
    case DType::F16:
      return adam_dispatch_lp<F16>(param, grad, exp_avg, exp_avg_sq, param_lp, lpdt, n, s);
  }
  throw std::invalid_argument("adamw_cpu: unsupported grad dtype");
}

}  // namespace zk
