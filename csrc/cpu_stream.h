// Whether the fp32 CPU AdamW kernel (adam_cpu.cpp) writes the param's bf16 copy (param_lp)
// with non-temporal stores. It reads every other array it writes, so those lines are in the
// cache when written; param_lp is only written, so an ordinary store first reads each line
// from memory (read for ownership): 2 bytes per element on top of the step's 28. A streaming
// store skips that read but leaves the copy out of the cache: worth it only when the step
// moves more than the cache holds, so the copy would have been evicted before its next use
// anyway. (Measured on a 2-core Zen 3 at 2^25 elements: the fp32 step 1.02-1.05x faster at 1
// and 2 threads; the compressed kernel's bf16 copy gained at 2 threads with bf16 moments,
// lost 2-3% at 1 thread and with int8 moments, so it keeps ordinary stores. AVX2 only: an
// AVX-512 build's 16-lane loop keeps ordinary stores, not measured there.)
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace zk {

// ZEROKERN_STREAM_STORES: "0" never, "1" whenever the copy is 32-byte aligned, unset or
// anything else: when aligned and the step moves more than twice the last-level cache
// (n * bytes_per_elt; 32 MiB where the size is not reported).
inline bool stream_lp(const void* lp, int64_t n, int64_t bytes_per_elt) {
  if (lp == nullptr || (reinterpret_cast<uintptr_t>(lp) & 31) != 0) return false;
  if (const char* e = std::getenv("ZEROKERN_STREAM_STORES"); e != nullptr && e[0] && !e[1]) {
    if (e[0] == '0') return false;
    if (e[0] == '1') return true;
  }
  static const int64_t llc = [] {
    const long s = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return s > 0 ? int64_t(s) : int64_t(32) << 20;
  }();
  return n * bytes_per_elt > 2 * llc;
}

}  // namespace zk
