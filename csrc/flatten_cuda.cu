// Many-segment copy (flatten into / unflatten from a flat bucket) in one launch.
//
// The host has cut every segment into chunks of at most kCopyChunkBytes; block b copies chunk
// b (and b + gridDim.x, ... when there are more chunks than the grid allows). A block picks
// the widest word W in {16, 8, 4, 2, 1} bytes for which src and dst sit at the same offset
// modulo W, copies the few head bytes up to dst's next W boundary one by one, the body as
// W-byte words (uint4 = 16-byte accesses when both ends are 16-byte aligned, which covers the
// all-16-aligned case), and the < W tail bytes one by one. Plain weak accesses: the copy is
// ordered with the caller's other work by the stream only.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels.h"

namespace zk {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 0x7FFFFFFF;  // gridDim.x limit

static_assert(kCopyChunkBytes / 16 <= int64_t(1) << 30, "chunk too long for int indexing");

template <typename W>
__device__ __forceinline__ void copy_words(const char* __restrict__ src, char* __restrict__ dst,
                                           int bytes) {
  constexpr int kW = int(sizeof(W));
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  int head = int((kW - d % kW) % kW);
  if (head > bytes) head = bytes;
  const int nw = (bytes - head) / kW;
  const int body_end = head + nw * kW;
  const int t = threadIdx.x;
  if (t < head) dst[t] = src[t];
  const W* __restrict__ s = reinterpret_cast<const W*>(src + head);
  W* __restrict__ o = reinterpret_cast<W*>(dst + head);
  int i = t;
  // Four words in flight per thread, then the remainder.
  for (; i + 3 * kThreads < nw; i += 4 * kThreads) {
    const W a = s[i], b = s[i + kThreads], c = s[i + 2 * kThreads], e = s[i + 3 * kThreads];
    o[i] = a;
    o[i + kThreads] = b;
    o[i + 2 * kThreads] = c;
    o[i + 3 * kThreads] = e;
  }
  for (; i < nw; i += kThreads) o[i] = s[i];
  if (t < bytes - body_end) dst[body_end + t] = src[body_end + t];
}

__global__ void __launch_bounds__(kThreads)
    copy_chunks_kernel(const CopySegment* __restrict__ chunks, int64_t nchunks) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const CopySegment seg = chunks[c];
    // Device allocations are global memory; saying so turns generic LD/ST into LDG/STG.
    __builtin_assume(__isGlobal(seg.src));
    __builtin_assume(__isGlobal(seg.dst));
    const int bytes = int(seg.bytes);  // <= kCopyChunkBytes
    const uintptr_t phase = reinterpret_cast<uintptr_t>(seg.src) ^
                            reinterpret_cast<uintptr_t>(seg.dst);
    if (phase % 16 == 0) copy_words<uint4>(seg.src, seg.dst, bytes);
    else if (phase % 8 == 0) copy_words<uint2>(seg.src, seg.dst, bytes);
    else if (phase % 4 == 0) copy_words<uint32_t>(seg.src, seg.dst, bytes);
    else if (phase % 2 == 0) copy_words<uint16_t>(seg.src, seg.dst, bytes);
    else copy_words<uint8_t>(seg.src, seg.dst, bytes);
  }
}

}  // namespace

void copy_chunks_cuda(const CopySegment* chunks_dev, int64_t nchunks, void* stream) {
  if (nchunks < 0) throw std::invalid_argument("zerokern copy_chunks_cuda: negative count");
  if (nchunks == 0) return;
  const unsigned grid = unsigned(nchunks < kMaxGrid ? nchunks : kMaxGrid);
  copy_chunks_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(chunks_dev,
                                                                                nchunks);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("zerokern copy_chunks_cuda: kernel launch: ") +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace zk
