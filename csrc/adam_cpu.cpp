// Fused mixed-precision AdamW over one flat shard on the CPU: one pass reads grad, master,
// m, v and writes master, m, v and (optionally) the 16-bit param copy. OpenMP splits the
// shard into contiguous per-thread ranges; inside a range the lanes of cpu_lanes.h run
// AVX-512 (16 lanes), then AVX2 (8), then single elements, with 16-bit values converted in
// registers. The per-element formula is in kernels.h, spelled once in cpu_lanes.h.
// Contraction off and no errno, before the includes: see cpu_lanes.h.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-math-errno")
#endif
#include <omp.h>

#include <algorithm>
#include <stdexcept>

#include "cpu_lanes.h"
#include "cpu_stream.h"
#include "cpu_vec.h"
#include "kernels.h"

namespace zk {
namespace {

// Below this many elements threads cost more than they save.
constexpr int64_t kParallelMin = 1 << 15;

// Elements [i, end) in chunks of V::N; returns where it stopped.
template <class V, typename G, typename LP, bool LERP_LOW>
int64_t adam_lanes(float* p, const G* g, float* m, float* v, LP* lp, int64_t i, int64_t end,
                   const AdamScalars& s, bool stream) {
  using F = typename V::F;
  const AdamCoeffs<V> k(s);
  // Two chunks per iteration: the 16-bit copy of both goes out in one store (AVX2 packs 16
  // lanes with one pack and one permute instead of two of each; Zen 3, 1 thread, in L1:
  // 0.86 -> 0.80 ns per element with a bf16 copy).
  for (; i + 2 * V::N <= end; i += 2 * V::N) {
    F p0 = V::ld(p + i), m0 = V::ld(m + i), v0 = V::ld(v + i);
    F p1 = V::ld(p + i + V::N), m1 = V::ld(m + i + V::N), v1 = V::ld(v + i + V::N);
    adam_update<V, LERP_LOW>(k, V::template ldt<G>(g + i), p0, m0, v0);
    adam_update<V, LERP_LOW>(k, V::template ldt<G>(g + i + V::N), p1, m1, v1);
    V::st(p + i, p0);
    V::st(m + i, m0);
    V::st(v + i, v0);
    V::st(p + i + V::N, p1);
    V::st(m + i + V::N, m1);
    V::st(v + i + V::N, v1);
    if constexpr (!std::is_same_v<LP, void>) {
      bool streamed = false;
#ifdef ZK_AVX2
      if constexpr (std::is_same_v<V, L8> && std::is_same_v<LP, BF16>) {
        if (stream) {  // i advances by 16 elements (32 bytes): lp + i stays aligned
          Vec8<BF16>::store2_nt(lp + i, p0, p1);
          streamed = true;
        }
      }
#endif
      if (!streamed) V::template stt2<LP>(lp + i, p0, p1);
    }
  }
  for (; i + V::N <= end; i += V::N) {
    F pi = V::ld(p + i), mi = V::ld(m + i), vi = V::ld(v + i);
    adam_update<V, LERP_LOW>(k, V::template ldt<G>(g + i), pi, mi, vi);
    V::st(p + i, pi);
    V::st(m + i, mi);
    V::st(v + i, vi);
    if constexpr (!std::is_same_v<LP, void>) V::template stt<LP>(lp + i, pi);
  }
  return i;
}

// LERP_LOW is a template parameter so the inner loops carry no branch on it.
template <typename G, typename LP, bool LERP_LOW>
void adam_range(float* p, const G* g, float* m, float* v, LP* lp, int64_t begin, int64_t end,
                const AdamScalars& s, bool stream) {
  int64_t i = begin;
#ifdef ZK_AVX512
  i = adam_lanes<L16, G, LP, LERP_LOW>(p, g, m, v, lp, i, end, s, stream);
#endif
#ifdef ZK_AVX2
  i = adam_lanes<L8, G, LP, LERP_LOW>(p, g, m, v, lp, i, end, s, stream);
#endif
  adam_lanes<L1, G, LP, LERP_LOW>(p, g, m, v, lp, i, end, s, stream);
#ifdef ZK_AVX2
  // Streamed stores are weakly ordered: visible to every reader before the kernel returns.
  if (stream) _mm_sfence();
#endif
}

template <typename G, typename LP>
void adam_launch(float* p, const void* g, float* m, float* v, void* lp, int64_t n,
                 const AdamScalars& s) {
  const G* gt = static_cast<const G*>(g);
  LP* lpt = static_cast<LP*>(lp);
  auto range = s.one_minus_beta1 < 0.5f ? &adam_range<G, LP, true> : &adam_range<G, LP, false>;
  // (The bytes one element moves: fp32 param and moments read and written, grad, copy.)
  const bool stream = std::is_same_v<LP, BF16> && stream_lp(lp, n, 24 + int64_t(sizeof(G)) + 2);
  if (n < kParallelMin) {
    range(p, gt, m, v, lpt, 0, n, s, stream);
    return;
  }
#pragma omp parallel
  {
    // Contiguous ranges, rounded to 64 elements (a cache line of fp32) so no two threads
    // write the same line.
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((n + nt - 1) / nt + 63) / 64 * 64;
    const int64_t b = std::min(n, t * per), e = std::min(n, b + per);
    range(p, gt, m, v, lpt, b, e, s, stream);
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
