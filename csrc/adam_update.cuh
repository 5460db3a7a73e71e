// The fp32 AdamW update of kernels.h on a CUDA device, spelled once for every CUDA kernel
// (adam_cuda.cu, adam_compressed_cuda.cu): the rounding contract's three fmas, every other
// operation one IEEE rounding, written with __f*_rn intrinsics so nvcc can neither contract
// nor reassociate (the build passes no fast math, so subnormals are kept). The same per-element
// arithmetic as the CPU lanes (cpu_lanes.h) and the Triton helper (kernels/triton/adamw.py).
#pragma once
#include <cuda_runtime.h>

#include "kernels.h"

namespace zk {

// Kernel-side scalars: AdamScalars plus the lerp branch and 1 - w, decided once on the host.
struct Coeffs {
  float decay, w, one_minus_w, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, inv_grad_scale;
  bool w_small;
};

inline Coeffs coeffs_of(const AdamScalars& s) {
  Coeffs k;
  k.decay = s.decay;
  k.w = s.one_minus_beta1;
  k.one_minus_w = 1.0f - s.one_minus_beta1;  // fp32, as torch's lerp and the oracle compute it
  k.w_small = (s.one_minus_beta1 < 0.0f ? -s.one_minus_beta1 : s.one_minus_beta1) < 0.5f;
  k.beta2 = s.beta2;
  k.one_minus_beta2 = s.one_minus_beta2;
  k.step_size = s.step_size;
  k.bc2_sqrt = s.bc2_sqrt;
  k.eps = s.eps;
  k.inv_grad_scale = s.inv_grad_scale;
  return k;
}

// One element: graw is the widened gradient before its scaling; p, m, v are updated in place.
// FOLDED: fold_bias_correction's scalars (bf16 moments, int8 format version 3),
// bc2_sqrt == 1: the division by it is exact, so it is skipped (the same bits, one division
// less).
template <bool FOLDED = false>
__device__ __forceinline__ void adam_elem(float& p, float graw, float& m, float& v,
                                          const Coeffs& k) {
  const float g = __fmul_rn(graw, k.inv_grad_scale);
  const float pd = __fmul_rn(p, k.decay);
  const float d = __fsub_rn(g, m);
  // torch's lerp_: w < 0.5 ? m + w*(g-m) : g - (g-m)*(1-w), each one fma.
  const float mi = k.w_small ? __fmaf_rn(k.w, d, m) : __fmaf_rn(-d, k.one_minus_w, g);
  // mul_(beta2) then addcmul_(g, g, value=1-beta2): v*b2 + ((1-b2)*g)*g, the sum fused.
  const float vi = __fmaf_rn(__fmul_rn(k.one_minus_beta2, g), g, __fmul_rn(v, k.beta2));
  const float root = __fsqrt_rn(vi);
  const float denom = __fadd_rn(FOLDED ? root : __fdiv_rn(root, k.bc2_sqrt), k.eps);
  // addcdiv_(m, denom, value=-step_size): p - step_size * (m / denom), fused.
  p = __fmaf_rn(-k.step_size, __fdiv_rn(mi, denom), pd);
  m = mi;
  v = vi;
}

}  // namespace zk
