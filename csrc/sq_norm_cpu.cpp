// Sum of squares of a flat fp32/bf16/fp16 tensor on the CPU. Each element is widened to
// double before squaring (exact for 24-bit mantissas) and accumulated in double, so the
// result does not depend on the size of the shard; inf and nan propagate naturally.
#include <omp.h>

#include <algorithm>
#include <stdexcept>

#include "cpu_vec.h"
#include "kernels.h"

namespace zk {
namespace {

template <typename T>
double sq_range(const T* x, int64_t b, int64_t e) {
  double acc = 0.0;
  int64_t i = b;
#ifdef ZK_AVX2
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; i + 8 <= e; i += 8) {
    __m256 f = Vec8<T>::load(x + i);
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  acc = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < e; ++i) {
    double f = Scalar<T>::load(x + i);
    acc += f * f;
  }
  return acc;
}

template <typename T>
double sq_launch(const void* xv, int64_t n) {
  const T* x = static_cast<const T*>(xv);
  if (n < (1 << 16)) return sq_range(x, 0, n);
  double total = 0.0;
  // Fixed per-thread ranges and an ordered sum of the partials keep the result the same
  // from call to call for a given thread count.
  const int nt = omp_get_max_threads();
  double partial[256] = {0.0};
  const int used = std::min(nt, 256);
#pragma omp parallel num_threads(used)
  {
    const int64_t t = omp_get_thread_num(), k = omp_get_num_threads();
    const int64_t per = (n + k - 1) / k;
    partial[t] = sq_range(x, std::min(n, t * per), std::min(n, (t + 1) * per));
  }
  for (int t = 0; t < used; ++t) total += partial[t];
  return total;
}

}  // namespace

double sq_norm_cpu(const void* x, DType dt, int64_t n) {
  switch (dt) {
    case DType::F32: return sq_launch<float>(x, n);
    case DType::BF16: return sq_launch<BF16>(x, n);
    case DType::F16: return sq_launch<F16>(x, n);
  }
  throw std::invalid_argument("sq_norm_cpu: unsupported dtype");
}

}  // namespace zk
