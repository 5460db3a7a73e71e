// What the AdamW update's square root and division alone cost on this CPU: the floor under
// any CPU kernel that computes AdamW's m / (sqrt(v) + eps) with IEEE operations, one thread.
//
//   c++ -O2 -march=native bench/divider_floor.cpp -o /tmp/divider_floor && /tmp/divider_floor
//
// Each loop streams 4096-element arrays that stay in L1 or L2 (no memory traffic), with
// independent iterations (throughput, not latency), and reports the best of its repeats in ns
// per element and in ms for 2^25 elements, the size bench_adam.py's goals are stated at.
// Compared there with torch's fused AdamW at 2^25 (the same machine, the same clock), it
// says which ratios a kernel could reach if everything but the divider were free.
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum class Op { Sqrt, Div, Update };

#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
#define ZK_VEC(op) _mm512_##op
constexpr int kLanes = 16;
using F = __m512;
#else
#define ZK_VEC(op) _mm256_##op
constexpr int kLanes = 8;
using F = __m256;
#endif
F ld(const float* p) { return ZK_VEC(loadu_ps)(p); }
void st(float* p, F x) { ZK_VEC(storeu_ps)(p, x); }
F set1(float x) { return ZK_VEC(set1_ps)(x); }
F vsqrt(F x) { return ZK_VEC(sqrt_ps)(x); }
F vdiv(F a, F b) { return ZK_VEC(div_ps)(a, b); }
F vadd(F a, F b) { return ZK_VEC(add_ps)(a, b); }
#else
constexpr int kLanes = 1;
using F = float;
F ld(const float* p) { return *p; }
void st(float* p, F x) { *p = x; }
F set1(float x) { return x; }
F vsqrt(F x) { return std::sqrt(x); }
F vdiv(F a, F b) { return a / b; }
F vadd(F a, F b) { return a + b; }
#endif

template <Op OP>
__attribute__((noinline)) void sweep(const float* m, const float* v, float* out, long n) {
  const F eps = set1(1e-8f);
  for (long i = 0; i < n; i += kLanes) {
    if constexpr (OP == Op::Sqrt) st(out + i, vsqrt(ld(v + i)));
    if constexpr (OP == Op::Div) st(out + i, vdiv(ld(m + i), ld(v + i)));
    if constexpr (OP == Op::Update) st(out + i, vdiv(ld(m + i), vadd(vsqrt(ld(v + i)), eps)));
  }
}

template <Op OP>
double best_ns_per_element(const float* m, const float* v, float* out, long n) {
  constexpr int kCalls = 200, kRepeats = 40;
  double best = 1e30;
  for (int r = 0; r < kRepeats; ++r) {
    const double t0 = now();
    for (int c = 0; c < kCalls; ++c) sweep<OP>(m, v, out, n);
    best = std::min(best, (now() - t0) / (double(kCalls) * double(n)));
  }
  return best * 1e9;
}

}  // namespace

int main() {
  const long n = 4096;  // 48 KiB in all: within L1 (32-64 KiB) or L2 on any x86 core
  std::vector<float> m(n), v(n), out(n);
  for (long i = 0; i < n; ++i) {
    m[i] = 1e-3f * float(i % 97 - 48);
    v[i] = 1e-6f * float(1 + i % 89);
  }
  std::printf("lanes per instruction: %d\n", kLanes);
  std::printf("%-28s %10s %16s\n", "loop", "ns/elt", "ms at 2^25 elts");
  const double n25 = double(1L << 25) * 1e-6;
  for (int pass = 0; pass < 2; ++pass) {
    const double s = best_ns_per_element<Op::Sqrt>(m.data(), v.data(), out.data(), n);
    const double d = best_ns_per_element<Op::Div>(m.data(), v.data(), out.data(), n);
    const double u = best_ns_per_element<Op::Update>(m.data(), v.data(), out.data(), n);
    std::printf("%-28s %10.3f %16.2f\n", "sqrt(v)", s, s * n25);
    std::printf("%-28s %10.3f %16.2f\n", "m / v", d, d * n25);
    std::printf("%-28s %10.3f %16.2f\n", "m / (sqrt(v) + eps)", u, u * n25);
  }
  return 0;
}
