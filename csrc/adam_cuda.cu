// Fused mixed-precision AdamW over one flat shard on a CUDA device: one launch reads grad,
// master, m, v and writes master, m, v and (optionally) the 16-bit param copy.
//
// Vector path: every thread-iteration handles 8 consecutive elements, so the fp32 arrays move
// as two 16-byte accesses each and the 16-bit arrays (grad, param_lp) as one. A shard whose
// arrays are not 16-byte aligned at element 0 but share an alignment phase (e.g. a view that
// starts a few elements into an aligned buffer) peels up to 7 head elements; the < 8 tail
// elements are handled by the first threads of the grid. Arrays whose phases cannot all be
// reconciled use the scalar kernel. Indices are int64_t throughout (shards > 2^31 elements).
//
// Per-element arithmetic: adam_elem of adam_update.cuh, the formula of kernels.h rounded
// step by step as the CPU lanes (cpu_lanes.h) do it: the lerp, the addcmul and the final
// addcdiv are single fused multiply-adds (as nvcc compiles torch's own lerp_/addcmul_/addcdiv_ CUDA kernels),
// every other operation is one IEEE rounding (true division, correctly rounded sqrt).
// torch.optim.AdamW on CUDA differs in one place: it divides sqrt(v) by bc2_sqrt as a multiply
// by an fp32 reciprocal. Written with __f*_rn intrinsics so nvcc cannot contract differently.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "adam_update.cuh"
#include "kernels.h"

namespace zk {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 4;
constexpr int kVec = 8;  // elements per thread-iteration on the vector path

struct NoLp {};  // "no param_lp" marker type

// ---- element access --------------------------------------------------------------------

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float load1(const float* p) { return *p; }
  static __device__ __forceinline__ void store1(float* p, float x) { *p = x; }
  static __device__ __forceinline__ void load8(const float* p, float (&x)[kVec]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  }
  static __device__ __forceinline__ void store8(float* p, const float (&x)[kVec]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
};

// One 16-byte global store (a plain weak st.global.v4, i.e. STG.E.128). Written out because
// `*reinterpret_cast<uint4*>(p) = u` of the packed 16-bit values comes out of nvcc 13.0 as
// four 32-bit STG in this kernel (the fp32 float4 stores do not), and __stwb's explicit .wb
// becomes STG.E.128.STRONG.SM. p must be a 16-byte aligned global address.
__device__ __forceinline__ void store16(void* p, uint4 u) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y),
               "r"(u.z), "r"(u.w)
               : "memory");
}

// 16-bit types: exact widening; round-to-nearest-even narrowing (the same bits torch's
// CUDA .to(bfloat16/float16) produces, NaN included).
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(uint32_t w) {
    return __uint_as_float(w & 0xFFFF0000u);
  }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // .x (low half) = a
    return uint32_t(__bfloat16_as_ushort(h.x)) | (uint32_t(__bfloat16_as_ushort(h.y)) << 16);
  }
  static __device__ __forceinline__ float load1(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  static __device__ __forceinline__ void store1(__nv_bfloat16* p, float x) {
    *p = __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&x)[kVec]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    x[0] = lo(u.x); x[1] = hi(u.x); x[2] = lo(u.y); x[3] = hi(u.y);
    x[4] = lo(u.z); x[5] = hi(u.z); x[6] = lo(u.w); x[7] = hi(u.w);
  }
  static __device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&x)[kVec]) {
    store16(p, make_uint4(pack(x[0], x[1]), pack(x[2], x[3]), pack(x[4], x[5]), pack(x[6], x[7])));
  }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ float lo(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
  }
  static __device__ __forceinline__ float hi(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);  // .x (low half) = a
    return uint32_t(__half_as_ushort(h.x)) | (uint32_t(__half_as_ushort(h.y)) << 16);
  }
  static __device__ __forceinline__ float load1(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ void store1(__half* p, float x) { *p = __float2half_rn(x); }
  static __device__ __forceinline__ void load8(const __half* p, float (&x)[kVec]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    x[0] = lo(u.x); x[1] = hi(u.x); x[2] = lo(u.y); x[3] = hi(u.y);
    x[4] = lo(u.z); x[5] = hi(u.z); x[6] = lo(u.w); x[7] = hi(u.w);
  }
  static __device__ __forceinline__ void store8(__half* p, const float (&x)[kVec]) {
    store16(p, make_uint4(pack(x[0], x[1]), pack(x[2], x[3]), pack(x[4], x[5]), pack(x[6], x[7])));
  }
};

// ---- kernels ---------------------------------------------------------------------------

template <typename G, typename L>
__device__ __forceinline__ void adam_one(float* __restrict__ param, const G* __restrict__ grad,
                                         float* __restrict__ exp_avg,
                                         float* __restrict__ exp_avg_sq, L* __restrict__ lp,
                                         int64_t i, const Coeffs& k) {
  float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
  adam_elem(p, Elem<G>::load1(grad + i), m, v, k);
  param[i] = p;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if constexpr (!std::is_same_v<L, NoLp>) Elem<L>::store1(lp + i, p);
}

// Elements [0, head) and [head + 8*nvec, n) element-wise, [head, head + 8*nvec) by vectors;
// every array is 16-byte aligned at element `head`.
template <typename G, typename L>
__global__ void __launch_bounds__(kThreads)
    adamw_vec_kernel(float* __restrict__ param, const G* __restrict__ grad,
                     float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                     L* __restrict__ lp, int64_t n, int64_t head, int64_t nvec, Coeffs k) {
  const int64_t tid = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = tid; i < nvec; i += stride) {
    const int64_t e = head + i * kVec;
    float p[kVec], g[kVec], m[kVec], v[kVec];
    Elem<float>::load8(param + e, p);
    Elem<G>::load8(grad + e, g);
    Elem<float>::load8(exp_avg + e, m);
    Elem<float>::load8(exp_avg_sq + e, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) adam_elem(p[j], g[j], m[j], v[j], k);
    Elem<float>::store8(param + e, p);
    Elem<float>::store8(exp_avg + e, m);
    Elem<float>::store8(exp_avg_sq + e, v);
    if constexpr (!std::is_same_v<L, NoLp>) Elem<L>::store8(lp + e, p);
  }
  // head < 8 and tail < 8 elements: one each for the first threads of the grid.
  const int64_t tail = head + nvec * kVec;
  if (tid < head) adam_one<G, L>(param, grad, exp_avg, exp_avg_sq, lp, tid, k);
  if (tid < n - tail) adam_one<G, L>(param, grad, exp_avg, exp_avg_sq, lp, tail + tid, k);
}

template <typename G, typename L>
__global__ void __launch_bounds__(kThreads)
    adamw_scalar_kernel(float* __restrict__ param, const G* __restrict__ grad,
                        float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                        L* __restrict__ lp, int64_t n, Coeffs k) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    adam_one<G, L>(param, grad, exp_avg, exp_avg_sq, lp, i, k);
}

// ---- launch ----------------------------------------------------------------------------

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("zerokern adamw_cuda: ") + what + ": " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

int grid_for(int64_t work) {
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  const int64_t cap = int64_t(sms > 0 ? sms : 1) * kBlocksPerSm;
  const int64_t need = (work + kThreads - 1) / kThreads;
  return int(need < 1 ? 1 : (need < cap ? need : cap));
}

// Bit h (h in [0, 8)) is set when address + h*elem_bytes is 16-byte aligned: the head
// lengths after which this array can be read with 16-byte vectors (none: not element-aligned).
unsigned phase_mask(const void* ptr, unsigned elem_bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  unsigned mask = 0;
  for (unsigned h = 0; h < kVec; ++h)
    if ((a + uintptr_t(h) * elem_bytes) % 16 == 0) mask |= 1u << h;
  return mask;
}

template <typename G, typename L>
void launch(float* param, const void* grad, float* exp_avg, float* exp_avg_sq, void* param_lp,
            int64_t n, const Coeffs& k, cudaStream_t stream) {
  const G* g = static_cast<const G*>(grad);
  L* lp = static_cast<L*>(param_lp);
  unsigned ok = phase_mask(param, 4) & phase_mask(exp_avg, 4) & phase_mask(exp_avg_sq, 4) &
                phase_mask(grad, sizeof(G));
  if constexpr (!std::is_same_v<L, NoLp>) ok &= phase_mask(param_lp, sizeof(L));
  if (ok != 0) {
    int64_t head = 0;
    while (!(ok & (1u << head))) ++head;
    if (head > n) head = n;
    const int64_t nvec = (n - head) / kVec;
    adamw_vec_kernel<G, L><<<grid_for(nvec), kThreads, 0, stream>>>(param, g, exp_avg,
                                                                    exp_avg_sq, lp, n, head,
                                                                    nvec, k);
  } else {
    adamw_scalar_kernel<G, L><<<grid_for(n), kThreads, 0, stream>>>(param, g, exp_avg,
                                                                   exp_avg_sq, lp, n, k);
  }
  check(cudaGetLastError(), "kernel launch");
}

template <typename G>
void dispatch_lp(float* param, const void* grad, float* exp_avg, float* exp_avg_sq,
                 void* param_lp, DType lpdt, int64_t n, const Coeffs& k, cudaStream_t stream) {
  if (param_lp == nullptr)
    return launch<G, NoLp>(param, grad, exp_avg, exp_avg_sq, nullptr, n, k, stream);
  switch (lpdt) {
    case DType::BF16:
      return launch<G, __nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, param_lp, n, k, stream);
    case DType::F16:
      return launch<G, __half>(param, grad, exp_avg, exp_avg_sq, param_lp, n, k, stream);
    default:
      throw std::invalid_argument("zerokern adamw_cuda: param_lp must be bf16 or fp16");
  }
}

}  // namespace

void adamw_cuda(float* param, const void* grad, DType gdt, float* exp_avg, float* exp_avg_sq,
                void* param_lp, DType lpdt, int64_t n, const AdamScalars& s, void* stream) {
  if (gdt != DType::F32 && gdt != DType::BF16 && gdt != DType::F16)
    throw std::invalid_argument("zerokern adamw_cuda: unsupported grad dtype");
  if (n < 0) throw std::invalid_argument("zerokern adamw_cuda: negative element count");
  if (n == 0) return;
  const Coeffs k = coeffs_of(s);
  const auto st = static_cast<cudaStream_t>(stream);
  switch (gdt) {
    case DType::F32:
      return dispatch_lp<float>(param, grad, exp_avg, exp_avg_sq, param_lp, lpdt, n, k, st);
    case DType::BF16:
      return dispatch_lp<__nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, param_lp, lpdt, n, k,
                                        st);
    case DType::F16:
      return dispatch_lp<__half>(param, grad, exp_avg, exp_avg_sq, param_lp, lpdt, n, k, st);
  }
}

}  // namespace zk
