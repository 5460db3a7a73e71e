// Many-to-one (and one-to-many) copies for gradient buckets on the CPU: every segment is cut
// into chunks of at most kCopyChunkBytes and the chunks are spread over OpenMP threads, so
// one call moves a whole bucket whatever the mix of tensor sizes.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace zk {

void copy_segments_cpu(const CopySegment* segs, int64_t nseg) {
  int64_t total = 0;
  for (int64_t i = 0; i < nseg; ++i) total += segs[i].bytes;
  if (total < (int64_t(1) << 20)) {  // small buckets: threads would cost more than the copy
    for (int64_t i = 0; i < nseg; ++i)
      if (segs[i].bytes > 0) std::memcpy(segs[i].dst, segs[i].src, size_t(segs[i].bytes));
    return;
  }
  std::vector<CopySegment> chunks;
  chunks.reserve(size_t(total / kCopyChunkBytes + nseg));
  for (int64_t i = 0; i < nseg; ++i) {
    for (int64_t off = 0; off < segs[i].bytes; off += kCopyChunkBytes) {
      int64_t len = std::min(kCopyChunkBytes, segs[i].bytes - off);
      chunks.push_back({segs[i].src + off, segs[i].dst + off, len});
    }
  }
  const int64_t nc = int64_t(chunks.size());
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nc; ++c) std::memcpy(chunks[c].dst, chunks[c].src, size_t(chunks[c].bytes));
}

}  // namespace zk
