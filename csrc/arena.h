// Bookkeeping for one contiguous memory arena (ZeRO paper §6.3, memory defragmentation).
//
// ArenaCore only does arithmetic on byte offsets into a buffer it never sees: the Python
// layer (zerokern/memory/arena.py) owns the torch buffer, turns offsets into tensor views and
// performs the copies that plan_defragment() asks for. Keeping torch out of this file keeps
// it fast to compile and independent of the torch C++ ABI; only arena.cpp sees pybind11.
//
// Thread-safety: every public method locks one std::mutex, so each call is atomic with
// respect to the others. A sequence of calls (e.g. plan_defragment() followed by the copies
// and the re-pointing of views) is NOT atomic; the Python Arena holds its own lock for that.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Forward declaration for bind_arena(). pybind11 gives its namespace hidden visibility on
// GCC/Clang; declaring it the same way avoids a visibility-mismatch warning in files that
// include this header before pybind11.
#if defined(__GNUG__) && !defined(_WIN32)
namespace pybind11 __attribute__((visibility("hidden"))) {
#else
namespace pybind11 {
#endif
class module_;
}  // namespace pybind11

namespace zk {

// Thrown by ArenaCore::alloc when no free run is large enough. The state is unchanged.
// Bound to Python as ArenaOOMError (a MemoryError subclass); what() includes the stats.
class ArenaOOM : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ArenaStats {
  int64_t capacity;
  int64_t in_use;        // sum of live blocks' reserved (alignment-rounded) sizes
  int64_t peak_in_use;   // max of in_use since construction or reset_peak()
  int64_t live_blocks;
  int64_t free_bytes;    // capacity - in_use
  int64_t largest_free;  // longest free run: the biggest alloc that can succeed
  double fragmentation;  // 1 - largest_free / free_bytes; 0 when free_bytes == 0
  int64_t num_allocs;    // successful alloc() calls
  int64_t num_frees;     // successful free() calls
};

// One relocation of a live block: copy `nbytes` bytes from offset src to offset dst.
struct ArenaMove {
  int64_t src;
  int64_t dst;
  int64_t nbytes;
};

class ArenaCore {
 public:
  // alignment must be a power of two (std::invalid_argument otherwise, as for a negative
  // capacity). A capacity that is not a multiple of alignment leaves a short unusable tail.
  ArenaCore(int64_t capacity_bytes, int64_t alignment);

  // Best fit: the smallest free run that holds round_up(max(nbytes, 1), alignment) bytes,
  // lowest offset among equals; the block takes the run's start and the rest stays free.
  // nbytes == 0 still reserves `alignment` bytes so every live block has a distinct offset.
  // Throws ArenaOOM (state unchanged) when no run is large enough.
  int64_t alloc(int64_t nbytes);

  // Releases the live block starting at `offset` and merges it with free neighbours.
  // std::invalid_argument if no live block starts there (unknown offset, double free).
  void free(int64_t offset);

  // Slides every live block down to the lowest free address, keeping address order, so that
  // afterwards all free space is one run at the end. Updates the bookkeeping immediately and
  // returns the copies that make the buffer match it, in the order they must be executed.
  std::vector<ArenaMove> plan_defragment();

  ArenaStats stats() const;
  // Live blocks as (offset, reserved size), ascending offset.
  std::vector<std::pair<int64_t, int64_t>> blocks() const;
  void reset_peak();

  int64_t capacity() const { return capacity_; }
  int64_t alignment() const { return alignment_; }

 private:
  int64_t reserved_size(int64_t nbytes) const;  // may return > capacity_ (never overflows)
  ArenaStats stats_locked() const;
  std::string oom_message(int64_t nbytes, int64_t need) const;
  void add_free(int64_t offset, int64_t size);
  void remove_free(std::map<int64_t, int64_t>::iterator it);

  const int64_t capacity_;
  const int64_t alignment_;

  // Free runs twice: by offset (for coalescing with neighbours on free) and by (size, offset)
  // (for best fit in O(log n)). Invariant: runs never touch each other (they would have been
  // merged) and both indexes hold exactly the same runs.
  std::map<int64_t, int64_t> free_by_offset_;            // offset -> size
  std::set<std::pair<int64_t, int64_t>> free_by_size_;   // (size, offset)
  std::map<int64_t, int64_t> live_;                      // offset -> reserved size

  int64_t in_use_ = 0;
  int64_t peak_in_use_ = 0;
  int64_t num_allocs_ = 0;
  int64_t num_frees_ = 0;

  mutable std::mutex mu_;
};

// Registers ArenaCore and ArenaOOMError on module m (called from bindings.cpp).
void bind_arena(pybind11::module_& m);

}  // namespace zk
