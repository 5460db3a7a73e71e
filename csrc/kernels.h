// Raw kernel entry points shared by the pybind11 bindings and the per-device sources.
// Deliberately free of torch headers: the .cu and OpenMP files compile in seconds and
// stay independent of the torch C++ ABI; only bindings.cpp sees at::Tensor.
#pragma once
#include <cstdint>

namespace zk {

// Element types the kernels accept. Values are part of the binding contract.
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// Scalars of one AdamW step, precomputed once on the host (in double, then rounded) so
// every backend applies the identical per-element fp32 formula:
//   g  = grad * inv_grad_scale
//   p  = p * decay                                   (decay = 1 - lr*wd)
//   m  = lerp(m, g, w = 1-b1): w < 0.5 ? m + w*(g-m) : g - (g-m)*(1-w)   (torch's lerp_)
//   v  = v * b2 + (1-b2) * g * g                     (torch's mul_ + addcmul_)
//   p  = p - step_size * (m / (sqrt(v) / bc2_sqrt + eps))
// Rounding contract (CPU, CUDA and Triton agree bit for bit where they follow it): the lerp,
// the v update (fma((1-b2)*g, g, v*b2)) and the final p update (fma(-step_size, m/denom, p))
// are single fused multiply-adds; every other operation, including sqrt and the two
// divisions, is rounded on its own (IEEE, no fast math). torch's CPU AdamW also fuses its
// vector lerp/addcmul, so we agree with it to about one ulp, not bitwise.
// bf16 moments and int8 format version 3 pass fold_bias_correction's scalars
// (zerokern/kernel_contract.py, folds_bias_correction):
// step_size * bc2_sqrt, eps * bc2_sqrt and bc2_sqrt = 1; its kernels skip that exact division.
struct AdamScalars {
  float decay;           // 1 - lr * weight_decay
  float one_minus_beta1; // 1 - beta1
  float beta2;
  float one_minus_beta2; // 1 - beta2
  float step_size;       // lr / (1 - beta1^step)
  float bc2_sqrt;        // sqrt(1 - beta2^step)
  float eps;
  float inv_grad_scale;  // 1 / grad_scale
};

// One in-place pass over a flat shard of n elements. grad has dtype gdt; param_lp may be
// null, else has dtype lpdt (BF16 or F16) and receives round-to-nearest-even(param).
void adamw_cpu(float* param, const void* grad, DType gdt, float* exp_avg, float* exp_avg_sq,
               void* param_lp, DType lpdt, int64_t n, const AdamScalars& s);

// Sum of squares accumulated in double; inf/nan propagate.
double sq_norm_cpu(const void* x, DType dt, int64_t n);

// One copy job: `bytes` bytes from src to dst (byte pointers, any alignment).
struct CopySegment {
  const char* src;
  char* dst;
  int64_t bytes;
};
void copy_segments_cpu(const CopySegment* segs, int64_t nseg);

// Longest piece a single worker (OpenMP iteration or CUDA block) copies.
constexpr int64_t kCopyChunkBytes = int64_t(1) << 16;

// -- Compressed optimizer state (issue 27) ----------------------------------------------------
// One in-place AdamW pass over a flat range of n elements whose state is compressed: the
// range contract of zerokern/ops/adamw_compressed.py, whose torch backend is the oracle every
// native kernel equals bit for bit. Blocks are kQuantBlock consecutive elements counted from
// the range's first element (the last one partial).
// U8 is format version 2 (the dynamic maps of zerokern.quant.maps, tables read from
// CompressedArgs::tables); U8V3 is format version 3 (zerokern.quant.fmt_v3: computed maps,
// the tables are not read).
enum class MomentFmt : int { F32 = 0, BF16 = 1, U8 = 2, U8V3 = 3 };
constexpr int64_t kQuantBlock = 256;
struct CompressedArgs {
  void* param;                 // pdt F32: the master (param_lp optional); BF16: updated with SR
  DType pdt;
  const void* grad;            // gdt F32 / BF16 / F16
  DType gdt;
  void* exp_avg;               // mfmt: both moments fp32, bf16, or uint8 codes
  void* exp_avg_sq;
  MomentFmt mfmt;
  float* exp_avg_absmax;       // U8 only: ceil(n / 256) fp32 each, else null
  float* exp_avg_sq_absmax;
  void* param_lp;              // F32 param only, may be null; lpdt BF16 or F16
  DType lpdt;
  const int64_t* sr_index;     // BF16 param only: element i's SR index = sr_index[i/256] + i%256
  uint64_t seed;               // SR key (Philox4x32-10 key = (seed lo, seed hi))
  uint32_t step;               // SR counter word 1 (the 1-based Adam step); word 0 = index
  const float* tables;         // 1024 fp32: signed map | 255 thresholds, +inf | unsigned map |
                               // 255 thresholds, +inf (zerokern.quant.maps.kernel_tables)
  int64_t n;
};
void adamw_compressed_cpu(const CompressedArgs& a, const AdamScalars& s);

#ifdef ZK_WITH_CUDA
// All pointers of `a` on the device (tables included); enqueued on `stream`.
void adamw_compressed_cuda(const CompressedArgs& a, const AdamScalars& s, void* stream);
// Same contracts on device pointers, enqueued on `stream` (a cudaStream_t).
void adamw_cuda(float* param, const void* grad, DType gdt, float* exp_avg, float* exp_avg_sq,
                void* param_lp, DType lpdt, int64_t n, const AdamScalars& s, void* stream);
// Writes the fp32 sum of squares of x into *out (device pointer). `workspace` is a device
// buffer of at least sq_norm_cuda_workspace_floats() floats. Deterministic (two passes).
int64_t sq_norm_cuda_workspace_floats();
void sq_norm_cuda(const void* x, DType dt, int64_t n, float* out, float* workspace, void* stream);
// Copies every chunk in one kernel launch, one thread block per chunk. `chunks_dev` is a
// device array of nchunks CopySegment entries, each at most kCopyChunkBytes long (the
// host splits longer segments in bindings.cpp).
// Blocks use 16-byte vector accesses when src, dst and length allow it.
void copy_chunks_cuda(const CopySegment* chunks_dev, int64_t nchunks, void* stream);
#endif

}  // namespace zk
