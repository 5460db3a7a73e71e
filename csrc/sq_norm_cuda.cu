// Sum of squares of a flat fp32/bf16/fp16 tensor on a CUDA device, deterministic.
//
// Pass 1: a grid of nblocks blocks (a function of n and of x's alignment only, at most
// kMaxBlocks) walks x with 16-byte vector loads; each thread accumulates squares in fp32 in
// one register per vector lane, folds its lanes in a fixed order, and a fixed-shape block tree
// (warp shuffles, then warp 0) leaves one partial per block in workspace[blockIdx.x].
// Pass 2: one block sums the nblocks partials in a fixed order and writes *out.
// The grouping of the additions depends only on (n, alignment of x), never on scheduling, so
// equal inputs give bitwise equal results. Nothing clamps: inf and nan propagate.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels.h"

namespace zk {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // workspace floats; ~8 resident blocks per SM on an H100
constexpr int kWarps = kThreads / 32;

template <typename T>
struct Sq;

template <>
struct Sq<float> {
  static constexpr int kLanes = 4;  // elements per 16-byte vector
  static __device__ __forceinline__ float load1(const float* p) { return *p; }
  static __device__ __forceinline__ void add_vec(const float* p, float (&acc)[kLanes]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    acc[0] = __fmaf_rn(a.x, a.x, acc[0]);
    acc[1] = __fmaf_rn(a.y, a.y, acc[1]);
    acc[2] = __fmaf_rn(a.z, a.z, acc[2]);
    acc[3] = __fmaf_rn(a.w, a.w, acc[3]);
  }
};

template <>
struct Sq<__nv_bfloat16> {
  static constexpr int kLanes = 8;
  static __device__ __forceinline__ float load1(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  static __device__ __forceinline__ void add_word(uint32_t w, float& a, float& b) {
    const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xFFFF0000u);
    a = __fmaf_rn(lo, lo, a);
    b = __fmaf_rn(hi, hi, b);
  }
  static __device__ __forceinline__ void add_vec(const __nv_bfloat16* p, float (&acc)[kLanes]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    add_word(u.x, acc[0], acc[1]);
    add_word(u.y, acc[2], acc[3]);
    add_word(u.z, acc[4], acc[5]);
    add_word(u.w, acc[6], acc[7]);
  }
};

template <>
struct Sq<__half> {
  static constexpr int kLanes = 8;
  static __device__ __forceinline__ float load1(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ void add_word(uint32_t w, float& a, float& b) {
    const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
    const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
    a = __fmaf_rn(lo, lo, a);
    b = __fmaf_rn(hi, hi, b);
  }
  static __device__ __forceinline__ void add_vec(const __half* p, float (&acc)[kLanes]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    add_word(u.x, acc[0], acc[1]);
    add_word(u.y, acc[2], acc[3]);
    add_word(u.z, acc[4], acc[5]);
    add_word(u.w, acc[6], acc[7]);
  }
};

// Fixed-shape block sum; the result is valid in thread 0. Ends with the block's threads in
// step so that the shared array can be reused by a following call.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kWarps];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xFFFFFFFFu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      v = __fadd_rn(v, __shfl_down_sync(0xFFFFFFFFu, v, off));
  }
  return v;
}

// Elements [0, head) and [head + lanes*nvec, n) one by one, [head, head + lanes*nvec) by
// 16-byte vectors (x + head is 16-byte aligned).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sq_partial_kernel(const T* __restrict__ x, int64_t n, int64_t head, int64_t nvec,
                      float* __restrict__ partials) {
  constexpr int L = Sq<T>::kLanes;
  const int64_t tid = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  float acc[L];
#pragma unroll
  for (int j = 0; j < L; ++j) acc[j] = 0.0f;
  const T* xv = x + head;
  int64_t i = tid;
  // Two vectors in flight per thread, then at most one left over.
  for (; i + stride < nvec; i += 2 * stride) {
    Sq<T>::add_vec(xv + i * L, acc);
    Sq<T>::add_vec(xv + (i + stride) * L, acc);
  }
  if (i < nvec) Sq<T>::add_vec(xv + i * L, acc);
  // < 8 head and < 8 tail elements: one each for the first threads of the grid.
  const int64_t tail = head + nvec * L;
  if (tid < head) {
    const float f = Sq<T>::load1(x + tid);
    acc[0] = __fmaf_rn(f, f, acc[0]);
  }
  if (tid < n - tail) {
    const float f = Sq<T>::load1(x + tail + tid);
    acc[1] = __fmaf_rn(f, f, acc[1]);
  }
  // Pairwise fold of the lanes, fixed order.
#pragma unroll
  for (int w = L / 2; w > 0; w >>= 1)
#pragma unroll
    for (int j = 0; j < w; ++j) acc[j] = __fadd_rn(acc[j], acc[j + w]);
  const float s = block_sum(acc[0]);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    sq_final_kernel(const float* __restrict__ partials, int nparts, float* __restrict__ out) {
  float v = 0.0f;
  for (int i = threadIdx.x; i < nparts; i += kThreads) v = __fadd_rn(v, partials[i]);
  const float s = block_sum(v);
  if (threadIdx.x == 0) *out = s;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("zerokern sq_norm_cuda: ") + what + ": " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

template <typename T>
void launch(const void* xv, int64_t n, float* out, float* workspace, cudaStream_t stream) {
  constexpr int L = Sq<T>::kLanes;
  const T* x = static_cast<const T*>(xv);
  int nblocks = 0;
  if (n > 0) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(x);
    if (a % sizeof(T) != 0)
      throw std::invalid_argument("zerokern sq_norm_cuda: x is not aligned to its element size");
    int64_t head = int64_t((16 - a % 16) % 16 / sizeof(T));
    if (head > n) head = n;
    const int64_t nvec = (n - head) / L;
    // Enough blocks for about two vectors per thread, at most kMaxBlocks.
    const int64_t want = (nvec + 2 * kThreads - 1) / (2 * kThreads);
    nblocks = int(want < 1 ? 1 : (want < kMaxBlocks ? want : kMaxBlocks));
    sq_partial_kernel<T><<<nblocks, kThreads, 0, stream>>>(x, n, head, nvec, workspace);
    check(cudaGetLastError(), "partial kernel launch");
  }
  sq_final_kernel<<<1, kThreads, 0, stream>>>(workspace, nblocks, out);  // n == 0: writes 0
  check(cudaGetLastError(), "final kernel launch");
}

}  // namespace

int64_t sq_norm_cuda_workspace_floats() { return kMaxBlocks; }

void sq_norm_cuda(const void* x, DType dt, int64_t n, float* out, float* workspace,
                  void* stream) {
  if (n < 0) throw std::invalid_argument("zerokern sq_norm_cuda: negative element count");
  const auto st = static_cast<cudaStream_t>(stream);
  switch (dt) {
    case DType::F32: return launch<float>(x, n, out, workspace, st);
    case DType::BF16: return launch<__nv_bfloat16>(x, n, out, workspace, st);
    case DType::F16: return launch<__half>(x, n, out, workspace, st);
  }
  throw std::invalid_argument("zerokern sq_norm_cuda: unsupported dtype");
}

}  // namespace zk
