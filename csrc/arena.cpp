// ArenaCore: free-list bookkeeping of a contiguous arena, plus its pybind11 binding.
// See arena.h for the contract; zerokern/memory/_arena_py.py mirrors it in pure Python and
// the two must stay decision-for-decision identical (tests/test_arena.py compares them).
#include "arena.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <limits>

namespace zk {

namespace {

bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace

ArenaCore::ArenaCore(int64_t capacity_bytes, int64_t alignment)
    : capacity_(capacity_bytes), alignment_(alignment) {
  if (capacity_bytes < 0) {
    throw std::invalid_argument("ArenaCore: capacity_bytes must be >= 0, got " +
                                std::to_string(capacity_bytes));
  }
  if (!is_power_of_two(alignment)) {
    throw std::invalid_argument("ArenaCore: alignment must be a power of two, got " +
                                std::to_string(alignment));
  }
  if (capacity_ > 0) add_free(0, capacity_);
}

int64_t ArenaCore::reserved_size(int64_t nbytes) const {
  // Anything larger than the arena fails anyway; returning it unrounded avoids overflow.
  if (nbytes > capacity_) return nbytes;
  if (nbytes == 0) return alignment_;
  const int64_t q = nbytes / alignment_ + (nbytes % alignment_ != 0 ? 1 : 0);
  return q * alignment_;  // <= capacity_ + alignment_ - 1: no overflow for any real buffer
}

void ArenaCore::add_free(int64_t offset, int64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void ArenaCore::remove_free(std::map<int64_t, int64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

int64_t ArenaCore::alloc(int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (nbytes < 0) {
    throw std::invalid_argument("ArenaCore.alloc: nbytes must be >= 0, got " +
                                std::to_string(nbytes));
  }
  const int64_t need = reserved_size(nbytes);
  // Smallest run with size >= need; among equal sizes the lowest offset (set order).
  auto fit = free_by_size_.lower_bound({need, std::numeric_limits<int64_t>::min()});
  if (fit == free_by_size_.end()) {
    // Nothing has been touched yet, so the state is exactly as before the call.
    throw ArenaOOM(oom_message(nbytes, need));
  }
  const int64_t run_size = fit->first;
  const int64_t offset = fit->second;
  free_by_size_.erase(fit);
  free_by_offset_.erase(offset);
  if (run_size > need) add_free(offset + need, run_size - need);

  live_.emplace(offset, need);
  in_use_ += need;
  if (in_use_ > peak_in_use_) peak_in_use_ = in_use_;
  ++num_allocs_;
  return offset;
}

void ArenaCore::free(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto live = live_.find(offset);
  if (live == live_.end()) {
    // Say whether the offset lies in free space (most likely a double free) or nowhere near
    // the start of a block (a foreign or corrupted offset).
    auto next = free_by_offset_.upper_bound(offset);
    bool in_free_run = false;
    if (next != free_by_offset_.begin()) {
      auto prev = std::prev(next);
      in_free_run = offset >= prev->first && offset < prev->first + prev->second;
    }
    throw std::invalid_argument(
        "ArenaCore.free: no live block starts at offset " + std::to_string(offset) +
        (in_free_run ? " (that address is free: double free?)"
                     : " (not an offset returned by alloc() on this arena)"));
  }
  int64_t start = offset;
  int64_t size = live->second;
  live_.erase(live);
  in_use_ -= size;
  ++num_frees_;

  // Coalesce: a free run ending exactly at `start` and/or one starting at start + size.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    auto after = std::next(next);
    remove_free(next);
    next = after;
  }
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      remove_free(prev);
    }
  }
  add_free(start, size);
}

std::vector<ArenaMove> ArenaCore::plan_defragment() {
  std::lock_guard<std::mutex> lock(mu_);
  // Blocks are visited in ascending address order and each lands at `cursor`, the sum of the
  // sizes of the blocks before it. Why executing the moves in this order is safe:
  //  * dst <= src for every block: everything below the block's old offset is either an
  //    earlier block (each of which is packed into no more space than it had) or free space.
  //  * A move's destination [dst, dst + n) ends at the next block's new offset, which is
  //    <= that block's old offset, which is < every later block's old offset. So no copy
  //    ever writes over the source of a block that has not been moved yet.
  //  * Destinations are disjoint and ascending, so no later copy overwrites an earlier
  //    move's destination either (a later source lies above every earlier destination).
  //  * A destination may overlap its OWN source (when the block slides by less than its
  //    size); the executor must copy such a move with memmove semantics (via a temporary).
  std::vector<ArenaMove> moves;
  std::map<int64_t, int64_t> packed;
  int64_t cursor = 0;
  for (const auto& [offset, size] : live_) {
    if (offset != cursor) moves.push_back({offset, cursor, size});
    packed.emplace_hint(packed.end(), cursor, size);
    cursor += size;
  }
  live_.swap(packed);
  free_by_offset_.clear();
  free_by_size_.clear();
  if (cursor < capacity_) add_free(cursor, capacity_ - cursor);
  return moves;
}

ArenaStats ArenaCore::stats_locked() const {
  ArenaStats s{};
  s.capacity = capacity_;
  s.in_use = in_use_;
  s.peak_in_use = peak_in_use_;
  s.live_blocks = static_cast<int64_t>(live_.size());
  s.free_bytes = capacity_ - in_use_;
  s.largest_free = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.fragmentation = s.free_bytes == 0 ? 0.0
                                      : 1.0 - static_cast<double>(s.largest_free) /
                                                  static_cast<double>(s.free_bytes);
  s.num_allocs = num_allocs_;
  s.num_frees = num_frees_;
  return s;
}

ArenaStats ArenaCore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_locked();
}

std::string ArenaCore::oom_message(int64_t nbytes, int64_t need) const {
  const ArenaStats s = stats_locked();
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "arena out of memory: requested %lld bytes (%lld reserved), largest free run "
                "%lld bytes; capacity %lld, in use %lld, free %lld, fragmentation %.1f%%, "
                "live blocks %lld",
                static_cast<long long>(nbytes), static_cast<long long>(need),
                static_cast<long long>(s.largest_free), static_cast<long long>(s.capacity),
                static_cast<long long>(s.in_use), static_cast<long long>(s.free_bytes),
                100.0 * s.fragmentation, static_cast<long long>(s.live_blocks));
  return buf;
}

std::vector<std::pair<int64_t, int64_t>> ArenaCore::blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {live_.begin(), live_.end()};
}

void ArenaCore::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_in_use_ = in_use_;
}

namespace py = pybind11;

void bind_arena(py::module_& m) {
  // MemoryError subclass so `except MemoryError` catches it; the Python Arena re-raises it
  // as zerokern.memory.ArenaOutOfMemory with a suggestion to defragment.
  // Module-local registration (here and for the class): nothing outside this module passes
  // ArenaCore around in C++, and a second module binding the same source (a standalone test
  // build loaded next to zerokern._C) must not clash with this one in pybind11's registry.
  auto oom = py::register_local_exception<ArenaOOM>(m, "ArenaOOMError", PyExc_MemoryError);

  auto cls = py::class_<ArenaCore>(m, "ArenaCore", py::module_local(), R"doc(
Offset bookkeeping of one contiguous arena (best-fit free list with coalescing and
compaction planning). Sizes and offsets are in bytes; it never touches memory.

Thread-safety: each method call is atomic (one internal mutex). Multi-call sequences such as
plan_defragment() + copying + re-pointing views are not; zerokern.memory.Arena adds its own
lock around them.
)doc");
  cls.def(py::init<int64_t, int64_t>(), py::arg("capacity_bytes"), py::arg("alignment") = 256)
      .def("alloc", &ArenaCore::alloc, py::arg("nbytes"),
           "Offset of a new block of round_up(max(nbytes, 1), alignment) bytes (best fit). "
           "Raises ArenaOOMError, changing nothing, when no free run is large enough.")
      .def("free", &ArenaCore::free, py::arg("offset"),
           "Releases the live block at offset, merging free neighbours. ValueError if none.")
      .def(
          "plan_defragment",
          [](ArenaCore& self) {
            py::list out;
            for (const ArenaMove& mv : self.plan_defragment()) {
              out.append(py::make_tuple(mv.src, mv.dst, mv.nbytes));
            }
            return out;
          },
          "Compacts live blocks toward offset 0 (bookkeeping updated now) and returns the "
          "copies [(src, dst, nbytes)] to execute in list order; dst <= src, and a move may "
          "overlap its own source (copy it with memmove semantics).")
      .def(
          "stats",
          [](const ArenaCore& self) {
            const ArenaStats s = self.stats();
            py::dict d;
            d["capacity"] = s.capacity;
            d["in_use"] = s.in_use;
            d["peak_in_use"] = s.peak_in_use;
            d["live_blocks"] = s.live_blocks;
            d["free_bytes"] = s.free_bytes;
            d["largest_free"] = s.largest_free;
            d["fragmentation"] = s.fragmentation;
            d["num_allocs"] = s.num_allocs;
            d["num_frees"] = s.num_frees;
            return d;
          },
          "Counters as a dict (bytes are reserved, i.e. alignment-rounded, sizes).")
      .def("blocks", &ArenaCore::blocks,
           "Live blocks as [(offset, reserved_nbytes)], ascending offset.")
      .def("reset_peak", &ArenaCore::reset_peak, "Sets peak_in_use to the current in_use.")
      .def_property_readonly("capacity", &ArenaCore::capacity)
      .def_property_readonly("alignment", &ArenaCore::alignment);
  // Lets callers catch the right type from the class alone (the Python fallback core has
  // the same attribute), without knowing which module the class came from.
  cls.attr("OOMError") = oom;
}

}  // namespace zk
