// Format version 3 of the 8-bit moments (zerokern/quant/fmt_v3.py: computed maps) for the CUDA
// kernel (adam_compressed_cuda.cu). Host and device functions, so that a host build can check
// this very code against the oracle without a GPU (tests/test_cuda_fmt_v3_host.py); plain
// C++ when not compiled by nvcc.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define ZK_V3_HD __host__ __device__ __forceinline__
#else
#define ZK_V3_HD inline
#endif

namespace zk {
namespace v3 {

// Magnitude q means the fp32 pattern (q + bias) << 20: 3 mantissa bits, the top q 1.0.
constexpr uint32_t kSignedBias = 889, kUnsignedBias = 761, kHalf = 1u << 19;

ZK_V3_HD uint32_t bits_of(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

ZK_V3_HD float float_of(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

ZK_V3_HD int clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// The map value of code c (0..255): signed map 128 +- q (code 0 is -1.125), unsigned map q.
template <bool kSigned>
ZK_V3_HD float value(uint32_t c) {
  if constexpr (kSigned) {
    const uint32_t q = c >= 128u ? c - 128u : 128u - c;
    const uint32_t mag = q ? (q + kSignedBias) << 20 : 0u;
    return float_of(c < 128u ? mag | 0x80000000u : mag);
  } else {
    return float_of(c ? (c + kUnsignedBias) << 20 : 0u);
  }
}

// The code of a normalised value n: |n|'s pattern plus half a step, shifted right by 20
// (round to nearest, ties away from zero), re-biased, clamped; NaN -> the zero code (128
// signed, 0 unsigned); on the unsigned map a set sign bit (-0.0, negatives) -> 0.
template <bool kSigned>
ZK_V3_HD uint32_t code(float n) {
  const uint32_t u = bits_of(n);
  const uint32_t a = u & 0x7FFFFFFFu;
  const bool neg = (u >> 31) != 0u;
  const int e = int((a + kHalf) >> 20);  // a < 2^31: no overflow in uint32
  if (a > 0x7F800000u) return kSigned ? 128u : 0u;
  if constexpr (kSigned) {
    const uint32_t q = uint32_t(clamp(e - int(kSignedBias), 0, 127));
    return neg ? 128u - q : 128u + q;
  } else {
    return neg ? 0u : uint32_t(clamp(e - int(kUnsignedBias), 0, 255));
  }
}

}  // namespace v3
}  // namespace zk
