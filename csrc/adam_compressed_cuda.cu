// Fused AdamW over a flat range with compressed optimizer state (issue 27) on a CUDA device:
// the range contract of zerokern/ops/adamw_compressed.py, whose torch backend is the oracle
// this kernel equals bit for bit (NaN payloads aside: the GPU writes its canonical NaN).
//
// Work split: one warp per 256-element quantization block. A block's absmax then needs only
// warp-level reductions (no shared-memory exchange and no block barrier inside the loop), and
// the 8 elements each lane owns sit in two runs of 4 consecutive elements, at lane*4 and
// 128 + lane*4, so every warp-wide access of a full, aligned block is one contiguous span
// (512 B of fp32, 256 B of 16-bit, 128 B of codes) read or written with one 16/8/4-byte
// vector access per lane. Blocks that are partial (the last one) or whose arrays are not
// aligned to 4 elements take the element-wise path of the same code. Thread blocks of 8 warps
// stride over the quantization blocks; with 8-bit moments each thread block first copies the
// 1024-float map/threshold table (4 KiB) into shared memory, once.
//
// Per element: widen grad (fp32/bf16/fp16) and param (fp32 master or bf16), dequantize
// (code_map[c] * absmax, one fp32 multiply) or widen the moments, then the fp32 update of
// kernels.h with its rounding contract (three fmas, every other operation one IEEE rounding:
// __f*_rn intrinsics, so nvcc can neither contract nor reassociate; the build passes no fast
// math, so subnormals are kept). Then, by format:
//   * uint8 moments (format version 2, zerokern.quant.blockwise): A = max |x| over the block
//     as the maximum of the bit patterns with the sign cleared. For non-negative floats the
//     integer order is the value order and every NaN pattern lies above inf's, so the maximum
//     propagates NaN exactly like torch's amax (redux.sync on sm_80+). The scale is -A when no
//     element is +A (a second maximum, of the patterns as signed integers), else +A.
//     n = x * __fdiv_rn(1, d) (one division per block; d = the scale, 1 for a zero scale), or
//     x / d outside 2^-126 <= |d| < 2^126, and
//     the code is #{t_k < n} for n >= 0, #{t_k <= n} for n < 0, counted by an 8-step
//     branch-free binary search over the 256-entry threshold table (255 thresholds and +inf);
//     NaN compares false at every step, so it takes code 0.
//   * uint8 moments, format version 3 (zerokern.quant.fmt_v3, the V3 template flag): a code's
//     value is built from its bits (magnitude q is the fp32 pattern (q + bias) << 20, q = 0 is
//     0; no table, no shared memory). The scale is A itself (the same NaN-propagating
//     maximum of patterns), n is normalised as above with d = A, and the code is the pattern
//     of |n| plus half a step, shifted right by 20, re-biased and clamped; a NaN n takes the
//     zero code (128 signed, 0 unsigned), a negative one code 0 on the unsigned map.
//   * bf16 moments: round to nearest even; their update takes the folded scalars, as version
//     3's (adam_elem<true>). fp32 moments: stored as they are.
//   * fp32 param: stored, and param_lp (bf16/fp16) rounded to nearest even when given.
//   * bf16 param: stochastic rounding with 16 bits of Philox4x32-10 of the counter
//     (index / 8, step, 0, 0) under the key (seed lo, seed hi), computed here (ten rounds,
//     __umulhi) once per run of 4 elements (twice when the run straddles two groups of 8), with
//     index = sr_index[block] + the element's offset in the block (format version 2).
// Indices are int64_t; ranges longer than 2^31 elements are fine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "adam_update.cuh"
#include "fmt_v3.cuh"
#include "kernels.h"

namespace zk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = int(kQuantBlock);  // elements per quantization block = per warp task
constexpr int kRun = 4;                   // consecutive elements per lane and run
constexpr int kPer = kBlock / 32;         // elements per lane (two runs)
constexpr int kTable = 1024;              // floats in the map/threshold table
static_assert(kBlock == 256 && kPer == 2 * kRun, "the lane layout assumes 256-element blocks");

struct NoLp {};  // "no param_lp" marker type

template <typename G, typename P, typename L, typename M>
struct KArgs {
  P* __restrict__ param;
  const G* __restrict__ grad;
  M* __restrict__ exp_avg;
  M* __restrict__ exp_avg_sq;
  float* __restrict__ exp_avg_absmax;
  float* __restrict__ exp_avg_sq_absmax;
  L* __restrict__ param_lp;
  const int64_t* __restrict__ sr_index;
  const float* __restrict__ tables;
  int64_t n;
  int64_t nblocks;
  uint32_t seed_lo, seed_hi, step;
  bool aligned;  // every element array is aligned to 4 elements at element 0
  Coeffs k;
};

// Offset in its block of lane `lane`'s element e (0..7): two runs of 4, 128 apart.
__device__ __forceinline__ int elem_offset(int lane, int e) {
  return (e / kRun) * (kBlock / 2) + lane * kRun + (e % kRun);
}

// ---- element access -----------------------------------------------------------------------

// Global stores of 8 and 16 bytes written out: nvcc may split a packed uint2/uint4 store of
// 16-bit values into 32-bit stores (see adam_cuda.cu). p must be aligned to the width.
__device__ __forceinline__ void store8b(void* p, uint32_t a, uint32_t b) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

template <typename T>
struct Io;

template <>
struct Io<float> {
  static __device__ __forceinline__ float load1(const float* p) { return *p; }
  static __device__ __forceinline__ void store1(float* p, float x) { *p = x; }
  static __device__ __forceinline__ void load4(const float* p, float* x) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  }
  static __device__ __forceinline__ void store4(float* p, const float* x) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  }
};

// 16-bit floats: exact widening, round-to-nearest-even narrowing (hardware cvt.rn, no FTZ).
template <>
struct Io<__nv_bfloat16> {
  static __device__ __forceinline__ float widen(uint32_t h) { return __uint_as_float(h << 16); }
  static __device__ __forceinline__ uint32_t narrow(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  static __device__ __forceinline__ float load1(const __nv_bfloat16* p) {
    return widen(*reinterpret_cast<const unsigned short*>(p));
  }
  static __device__ __forceinline__ void store1(__nv_bfloat16* p, float x) {
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(narrow(x));
  }
  static __device__ __forceinline__ void load4(const __nv_bfloat16* p, float* x) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    x[0] = widen(u.x & 0xFFFFu); x[1] = widen(u.x >> 16);
    x[2] = widen(u.y & 0xFFFFu); x[3] = widen(u.y >> 16);
  }
  static __device__ __forceinline__ void store4(__nv_bfloat16* p, const float* x) {
    store8b(p, narrow(x[0]) | (narrow(x[1]) << 16), narrow(x[2]) | (narrow(x[3]) << 16));
  }
};

template <>
struct Io<__half> {
  static __device__ __forceinline__ float widen(uint32_t h) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
  static __device__ __forceinline__ uint32_t narrow(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
  static __device__ __forceinline__ float load1(const __half* p) {
    return widen(*reinterpret_cast<const unsigned short*>(p));
  }
  static __device__ __forceinline__ void store1(__half* p, float x) {
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(narrow(x));
  }
  static __device__ __forceinline__ void load4(const __half* p, float* x) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    x[0] = widen(u.x & 0xFFFFu); x[1] = widen(u.x >> 16);
    x[2] = widen(u.y & 0xFFFFu); x[3] = widen(u.y >> 16);
  }
  static __device__ __forceinline__ void store4(__half* p, const float* x) {
    store8b(p, narrow(x[0]) | (narrow(x[1]) << 16), narrow(x[2]) | (narrow(x[3]) << 16));
  }
};

// A lane's 8 elements of the block at `base` (len valid elements); invalid ones read as 0.
template <typename T>
__device__ __forceinline__ void load_lane(const T* base, int lane, bool vec, int len,
                                          float (&x)[kPer]) {
  if (vec) {
#pragma unroll
    for (int r = 0; r < kPer / kRun; ++r)
      Io<T>::load4(base + elem_offset(lane, r * kRun), x + r * kRun);
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int o = elem_offset(lane, e);
      x[e] = o < len ? Io<T>::load1(base + o) : 0.0f;
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_lane(T* base, int lane, bool vec, int len,
                                           const float (&x)[kPer]) {
  if (vec) {
#pragma unroll
    for (int r = 0; r < kPer / kRun; ++r)
      Io<T>::store4(base + elem_offset(lane, r * kRun), x + r * kRun);
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int o = elem_offset(lane, e);
      if (o < len) Io<T>::store1(base + o, x[e]);
    }
  }
}

// Codes: 4 per lane and run, one 32-bit word when vectorized.
__device__ __forceinline__ void load_codes(const uint8_t* base, int lane, bool vec, int len,
                                           uint32_t (&c)[kPer]) {
#pragma unroll
  for (int r = 0; r < kPer / kRun; ++r) {
    const int o0 = elem_offset(lane, r * kRun);
    if (vec) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(base + o0);
#pragma unroll
      for (int j = 0; j < kRun; ++j) c[r * kRun + j] = (w >> (8 * j)) & 0xFFu;
    } else {
#pragma unroll
      for (int j = 0; j < kRun; ++j) c[r * kRun + j] = o0 + j < len ? base[o0 + j] : 0u;
    }
  }
}

__device__ __forceinline__ void store_codes(uint8_t* base, int lane, bool vec, int len,
                                            const uint32_t (&c)[kPer]) {
#pragma unroll
  for (int r = 0; r < kPer / kRun; ++r) {
    const int o0 = elem_offset(lane, r * kRun);
    if (vec) {
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < kRun; ++j) w |= c[r * kRun + j] << (8 * j);
      *reinterpret_cast<uint32_t*>(base + o0) = w;
    } else {
#pragma unroll
      for (int j = 0; j < kRun; ++j)
        if (o0 + j < len) base[o0 + j] = static_cast<uint8_t>(c[r * kRun + j]);
    }
  }
}

// ---- 8-bit block quantization -------------------------------------------------------------

// Block scale over the warp (format version 2, zerokern.quant.blockwise): A = the largest
// |x| bit pattern (NaN-propagating, see the header), and the scale is -A when A > 0 and no
// element is +A (the largest pattern read as a signed integer is then not A's), else +A.
// Elements outside the block (o >= len) hold 0 and cannot raise either maximum past A.
__device__ __forceinline__ float warp_scale(const float (&x)[kPer]) {
  uint32_t mx = 0;
  int imax = INT_MIN;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    mx = max(mx, __float_as_uint(x[e]) & 0x7FFFFFFFu);
    imax = max(imax, __float_as_int(x[e]));
  }
  mx = __reduce_max_sync(0xFFFFFFFFu, mx);
  imax = __reduce_max_sync(0xFFFFFFFFu, imax);
  if (mx > 0x7F800000u || mx == 0u || imax == int(mx)) return __uint_as_float(mx);
  return __uint_as_float(mx | 0x80000000u);
}

// #{t_k < x} for x >= 0 (and NaN: no comparison holds), #{t_k <= x} for x < 0, over the 256
// non-decreasing entries of t (the last +inf, so the count stays below 256).
__device__ __forceinline__ uint32_t code_of(const float* t, float x) {
  const bool neg = x < 0.0f;
  int pos = 0;
#pragma unroll
  for (int step = kBlock / 2; step >= 1; step >>= 1) {
    const float tv = t[pos + step - 1];
    const bool below = neg ? (tv <= x) : (tv < x);
    pos += below ? step : 0;
  }
  return uint32_t(pos);
}

// Requantize a lane's 8 new values of one moment with the block's new signed scale: writes
// the codes to c and returns the scale (the value to store). n = x * fl(1 / d) when
// 2^-126 <= |d| < 2^126, else x / d (d = the scale, 1 for a zero scale).
__device__ __forceinline__ float quantize_lane(const float* thresholds, const float (&x)[kPer],
                                               uint32_t (&c)[kPer]) {
  const float scale = warp_scale(x);
  const float d = scale == 0.0f ? 1.0f : scale;
  const float ad = fabsf(d);
  const bool recip = ad >= 0x1p-126f && ad < 0x1p126f;  // warp-uniform
  const float r = __fdiv_rn(1.0f, d);
#pragma unroll
  for (int e = 0; e < kPer; ++e)
    c[e] = code_of(thresholds, recip ? __fmul_rn(x[e], r) : __fdiv_rn(x[e], d));
  return scale;
}

// ---- 8-bit block quantization, format version 3 -------------------------------------------

// Version 3's requantization of a lane's 8 new values: the scale is A = the largest |x|
// pattern over the warp (NaN-propagating as in warp_scale), n = x * fl(1 / d) when
// 2^-126 <= d < 2^126, else x / d (d = A, 1 for A = 0). Writes the codes, returns A.
template <bool kSigned>
__device__ __forceinline__ float quantize_lane_v3(const float (&x)[kPer], uint32_t (&c)[kPer]) {
  uint32_t mx = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) mx = max(mx, __float_as_uint(x[e]) & 0x7FFFFFFFu);
  const float scale = __uint_as_float(__reduce_max_sync(0xFFFFFFFFu, mx));
  const float d = scale == 0.0f ? 1.0f : scale;
  const bool recip = d >= 0x1p-126f && d < 0x1p126f;  // warp-uniform; false for NaN
  const float r = __fdiv_rn(1.0f, d);
#pragma unroll
  for (int e = 0; e < kPer; ++e)
    c[e] = v3::code<kSigned>(recip ? __fmul_rn(x[e], r) : __fdiv_rn(x[e], d));
  return scale;
}

// ---- stochastic rounding ------------------------------------------------------------------

// Philox4x32-10 of the counter (c0, c1, 0, 0) under the key (k0, k1): the four words
// ([Note: stochastic-rounding keys] in zerokern/quant/philox.py: c0 comes from the element's
// index in its parameter).
__device__ __forceinline__ uint4 philox4(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c2 = 0, c3 = 0;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {  // the key is raised before every round but the first
      k0 += kW0;
      k1 += kW1;
    }
    const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return make_uint4(c0, c1, c2, c3);
}

// The 16 random bits of element `index` from the words of its group index / 8
// (zerokern.quant.philox.sr_bits16): half index % 2 of word (index / 2) % 4.
__device__ __forceinline__ uint32_t pick16(const uint4& w, uint32_t index) {
  const uint32_t k = (index >> 1) & 3u;
  const uint32_t word = k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
  return (word >> (16u * (index & 1u))) & 0xFFFFu;
}

// zerokern.quant.rounding.stochastic_round_bf16 of one value with random word `bits`.
__device__ __forceinline__ uint32_t stochastic_round_bf16(float x, uint32_t bits) {
  constexpr uint32_t kInf = 0x7F800000u, kBf16Max = 0x7F7Fu, kBf16NaN = 0x7FC0u;
  const uint32_t u = __float_as_uint(x);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > kInf) return kBf16NaN;
  uint32_t out = (mag + (bits & 0xFFFFu)) >> 16;  // no overflow: mag + r < 2^32
  if (mag < kInf) out = min(out, kBf16Max);       // finite values saturate, never become inf
  return out | ((u >> 16) & 0x8000u);
}

// ---- the kernel ---------------------------------------------------------------------------

template <typename G, typename P, typename L, typename M, bool V3>
__global__ void __launch_bounds__(kThreads)
    adamw_compressed_kernel(const KArgs<G, P, L, M> a) {
  constexpr bool kU8 = std::is_same_v<M, uint8_t>;
  static_assert(kU8 || !V3, "format version 3 is an 8-bit format");
  // bf16 moments and version 3 take fold_bias_correction's scalars (bc2_sqrt == 1, checked by
  // adamw_compressed_cuda): adam_elem<true> skips that division.
  constexpr bool kFolded = V3 || std::is_same_v<M, __nv_bfloat16>;
  constexpr bool kSr = std::is_same_v<P, __nv_bfloat16>;
  constexpr bool kLp = !std::is_same_v<L, NoLp>;
  static_assert(!(kSr && kLp), "a bf16 param has no param_lp");

  const float* table = nullptr;
  if constexpr (kU8 && !V3) {  // version 3 reads no table
    __shared__ float smem_table[kTable];
    for (int i = threadIdx.x; i < kTable; i += kThreads) smem_table[i] = a.tables[i];
    __syncthreads();
    table = smem_table;
  }
  const int lane = threadIdx.x % 32;
  const int64_t first = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t stride = int64_t(gridDim.x) * kWarps;

  for (int64_t b = first; b < a.nblocks; b += stride) {
    const int64_t base = b * kBlock;
    const int64_t left = a.n - base;
    const int len = left < kBlock ? int(left) : kBlock;
    const bool vec = a.aligned && len == kBlock;  // warp-uniform

    float p[kPer], g[kPer], m[kPer], v[kPer];
    load_lane(a.param + base, lane, vec, len, p);
    load_lane(a.grad + base, lane, vec, len, g);
    if constexpr (kU8) {
      uint32_t cm[kPer], cv[kPer];
      load_codes(a.exp_avg + base, lane, vec, len, cm);
      load_codes(a.exp_avg_sq + base, lane, vec, len, cv);
      const float am = a.exp_avg_absmax[b], av = a.exp_avg_sq_absmax[b];
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        if constexpr (V3) {
          m[e] = __fmul_rn(v3::value<true>(cm[e]), am);
          v[e] = __fmul_rn(v3::value<false>(cv[e]), av);
        } else {
          m[e] = __fmul_rn(table[cm[e]], am);                 // signed map
          v[e] = __fmul_rn(table[2 * kBlock + cv[e]], av);    // unsigned map
        }
      }
    } else {
      load_lane(a.exp_avg + base, lane, vec, len, m);
      load_lane(a.exp_avg_sq + base, lane, vec, len, v);
    }

#pragma unroll
    for (int e = 0; e < kPer; ++e) adam_elem<kFolded>(p[e], g[e], m[e], v[e], a.k);

    if constexpr (kSr) {
      const uint32_t first_index = static_cast<uint32_t>(a.sr_index[b]);
      uint32_t out[kPer];
      // Each run of 4 consecutive elements lies in one or two Philox groups of 8.
#pragma unroll
      for (int r = 0; r < kPer / kRun; ++r) {
        const uint32_t i0 = first_index + uint32_t(elem_offset(lane, r * kRun));
        const uint4 wa = philox4(i0 >> 3, a.step, a.seed_lo, a.seed_hi);
        const uint4 wb = ((i0 + kRun - 1) >> 3) == (i0 >> 3)
                             ? wa
                             : philox4((i0 >> 3) + 1, a.step, a.seed_lo, a.seed_hi);
#pragma unroll
        for (int j = 0; j < kRun; ++j) {
          const uint32_t index = i0 + uint32_t(j);
          const uint32_t bits = pick16((index >> 3) == (i0 >> 3) ? wa : wb, index);
          out[r * kRun + j] = stochastic_round_bf16(p[r * kRun + j], bits);
        }
      }
      auto* dst = reinterpret_cast<unsigned short*>(a.param + base);
#pragma unroll
      for (int r = 0; r < kPer / kRun; ++r) {
        const int o0 = elem_offset(lane, r * kRun);
        if (vec) {
          store8b(dst + o0, out[r * kRun] | (out[r * kRun + 1] << 16),
                  out[r * kRun + 2] | (out[r * kRun + 3] << 16));
        } else {
#pragma unroll
          for (int j = 0; j < kRun; ++j)
            if (o0 + j < len) dst[o0 + j] = static_cast<unsigned short>(out[r * kRun + j]);
        }
      }
    } else {
      store_lane(a.param + base, lane, vec, len, p);
      if constexpr (kLp) store_lane(a.param_lp + base, lane, vec, len, p);
    }

    if constexpr (kU8) {
      if (!vec) {  // elements past the range must not count in the absmax (they are 0 anyway)
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          if (elem_offset(lane, e) >= len) {
            m[e] = 0.0f;
            v[e] = 0.0f;
          }
        }
      }
      uint32_t cm[kPer], cv[kPer];
      float am, av;
      if constexpr (V3) {
        am = quantize_lane_v3<true>(m, cm);
        av = quantize_lane_v3<false>(v, cv);
      } else {
        am = quantize_lane(table + kBlock, m, cm);
        av = quantize_lane(table + 3 * kBlock, v, cv);
      }
      store_codes(a.exp_avg + base, lane, vec, len, cm);
      store_codes(a.exp_avg_sq + base, lane, vec, len, cv);
      if (lane == 0) {
        a.exp_avg_absmax[b] = am;
        a.exp_avg_sq_absmax[b] = av;
      }
    } else {
      store_lane(a.exp_avg + base, lane, vec, len, m);
      store_lane(a.exp_avg_sq + base, lane, vec, len, v);
    }
  }
}

// ---- launch -------------------------------------------------------------------------------

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("zerokern adamw_compressed_cuda: ") + what + ": " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

[[noreturn]] void refuse(const char* what) {
  throw std::invalid_argument(std::string("zerokern adamw_compressed_cuda: ") + what);
}

bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename G, typename P, typename L, typename M, bool V3 = false>
void launch(const CompressedArgs& c, const Coeffs& k, cudaStream_t stream) {
  KArgs<G, P, L, M> a;
  a.param = static_cast<P*>(c.param);
  a.grad = static_cast<const G*>(c.grad);
  a.exp_avg = static_cast<M*>(c.exp_avg);
  a.exp_avg_sq = static_cast<M*>(c.exp_avg_sq);
  a.exp_avg_absmax = c.exp_avg_absmax;
  a.exp_avg_sq_absmax = c.exp_avg_sq_absmax;
  a.param_lp = static_cast<L*>(c.param_lp);
  a.sr_index = c.sr_index;
  a.tables = c.tables;
  a.n = c.n;
  a.nblocks = (c.n + kBlock - 1) / kBlock;
  a.seed_lo = static_cast<uint32_t>(c.seed);
  a.seed_hi = static_cast<uint32_t>(c.seed >> 32);
  a.step = c.step;
  a.k = k;
  a.aligned = aligned_to(c.param, kRun * sizeof(P)) && aligned_to(c.grad, kRun * sizeof(G)) &&
              aligned_to(c.exp_avg, kRun * sizeof(M)) &&
              aligned_to(c.exp_avg_sq, kRun * sizeof(M));
  if constexpr (!std::is_same_v<L, NoLp>)
    a.aligned = a.aligned && aligned_to(c.param_lp, kRun * sizeof(L));

  // As many thread blocks as can be resident at once (each strides over the quantization
  // blocks, so the 8-bit table is copied once per resident thread block), fewer if the
  // range is small. The grid changes only the speed, never the result, so the occupancy is
  // asked once per instantiation.
  static const int per_sm = [] {
    int v = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
              &v, adamw_compressed_kernel<G, P, L, M, V3>, kThreads, 0),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return v;
  }();
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  const int64_t cap = int64_t(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  const int64_t need = (a.nblocks + kWarps - 1) / kWarps;
  const int grid = int(need < cap ? need : cap);
  adamw_compressed_kernel<G, P, L, M, V3><<<grid, kThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "kernel launch");
}

template <typename G, typename P, typename L>
void by_moments(const CompressedArgs& c, const Coeffs& k, cudaStream_t st) {
  switch (c.mfmt) {
    case MomentFmt::F32: return launch<G, P, L, float>(c, k, st);
    case MomentFmt::BF16: return launch<G, P, L, __nv_bfloat16>(c, k, st);
    case MomentFmt::U8: return launch<G, P, L, uint8_t>(c, k, st);
    case MomentFmt::U8V3: return launch<G, P, L, uint8_t, true>(c, k, st);
  }
  refuse("mfmt must be F32, BF16, U8 or U8V3");
}

template <typename G>
void by_param(const CompressedArgs& c, const Coeffs& k, cudaStream_t st) {
  if (c.pdt == DType::BF16) return by_moments<G, __nv_bfloat16, NoLp>(c, k, st);
  if (c.param_lp == nullptr) return by_moments<G, float, NoLp>(c, k, st);
  if (c.lpdt == DType::BF16) return by_moments<G, float, __nv_bfloat16>(c, k, st);
  return by_moments<G, float, __half>(c, k, st);
}

}  // namespace

void adamw_compressed_cuda(const CompressedArgs& c, const AdamScalars& s, void* stream) {
  // The Python router validates shapes, dtypes and devices; these checks keep a wrong
  // binding from launching on null pointers or unknown formats.
  if (c.n < 0) refuse("n must be >= 0");
  if (c.n == 0) return;
  if (c.param == nullptr || c.grad == nullptr || c.exp_avg == nullptr ||
      c.exp_avg_sq == nullptr)
    refuse("param, grad, exp_avg and exp_avg_sq must be device pointers");
  if (c.pdt != DType::F32 && c.pdt != DType::BF16) refuse("pdt (param) must be F32 or BF16");
  if (c.gdt != DType::F32 && c.gdt != DType::BF16 && c.gdt != DType::F16)
    refuse("gdt (grad) must be F32, BF16 or F16");
  if (c.mfmt != MomentFmt::F32 && c.mfmt != MomentFmt::BF16 && c.mfmt != MomentFmt::U8 &&
      c.mfmt != MomentFmt::U8V3)
    refuse("mfmt must be F32, BF16, U8 or U8V3");
  if (c.mfmt == MomentFmt::U8 &&
      (c.exp_avg_absmax == nullptr || c.exp_avg_sq_absmax == nullptr || c.tables == nullptr))
    refuse("uint8 moments need exp_avg_absmax, exp_avg_sq_absmax and tables");
  if (c.mfmt == MomentFmt::U8V3 && (c.exp_avg_absmax == nullptr || c.exp_avg_sq_absmax == nullptr))
    refuse("uint8 moments need exp_avg_absmax and exp_avg_sq_absmax");
  // bf16 moments and version 3 skip the division by bc2_sqrt (adam_elem<true>): only exact
  // when it is 1.
  if ((c.mfmt == MomentFmt::U8V3 || c.mfmt == MomentFmt::BF16) && s.bc2_sqrt != 1.0f)
    refuse("bf16 moments and format version 3 take the folded scalars "
           "(fold_bias_correction: bc2_sqrt == 1)");
  if (c.pdt == DType::BF16) {
    if (c.param_lp != nullptr) refuse("param_lp must be null with a bf16 param");
    if (c.sr_index == nullptr) refuse("sr_index is required with a bf16 param");
  } else if (c.param_lp != nullptr && c.lpdt != DType::BF16 && c.lpdt != DType::F16) {
    refuse("lpdt (param_lp) must be BF16 or F16");
  }
  const Coeffs k = coeffs_of(s);
  const auto st = static_cast<cudaStream_t>(stream);
  switch (c.gdt) {
    case DType::F32: return by_param<float>(c, k, st);
    case DType::BF16: return by_param<__nv_bfloat16>(c, k, st);
    case DType::F16: return by_param<__half>(c, k, st);
  }
}

}  // namespace zk
