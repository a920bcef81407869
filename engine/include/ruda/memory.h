// Accounting of tensor storage: live and peak bytes, per process and per rank.
//
// Every tensor allocation is charged to the tracker installed on the allocating thread (the
// process tracker unless a memory::Scope is active; with nested scopes, to each of theirs) and
// to the process tracker; the bytes are
// returned to the same trackers when the storage dies, whichever thread frees it. Emulated ranks
// install one scope per rank thread, so each rank reads its own figures.
//
// A limit caps each rank's live bytes: an allocation that would pass it (or that the system
// refuses) raises OutOfMemoryError naming the op, shape, dtype, requested, live and limit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <ruda/thread_flag.h>

namespace ruda::memory {

struct Stats {
  std::int64_t live_bytes = 0;   // bytes of tensor storage alive now
  std::int64_t peak_bytes = 0;   // the most that was alive at once since the last reset_peak
  std::int64_t allocations = 0;  // storages allocated since the tracker was made
};

class Tracker;

/// Figures of the tracker of the calling thread (its rank's, or the process's).
Stats stats();
/// Figures of the whole process.
Stats process_stats();
/// Sets the peak of the calling thread's tracker (and of the process's) to the bytes live now.
void reset_peak();

/// The most live tensor bytes a rank may hold (the calling thread's tracker: its emulated rank's,
/// or the process's), 0 for no limit. Initially RUDA_MEMORY_LIMIT (parse_size's format) or none.
std::int64_t limit();
/// Sets the limit for every rank of this process (0 removes it). Allocations already made stay.
/// `source` names where the limit came from in the error of an allocation past it (a program's
/// option, say "--memory-limit"; a string literal: it is kept, not copied).
void set_limit(std::int64_t bytes, const char* source = "memory::set_limit");
/// While alive, allocations on this thread ignore the limit (they are still counted): for a
/// measurement whose result decides whether the configuration fits, such as nn::probe_step.
class LimitSuspended : public ThreadFlagScope<LimitSuspended> {};
/// Bytes from "512MB", "2GiB", "1.5GB", "64k" or plain "1048576" (decimal units are powers of 1000,
/// binary ones of 1024; case-insensitive). ArgumentError on anything else, negative or overflowing,
/// a byte count with a fraction ("0.4") or a size below one byte ("0.0001KB").
std::int64_t parse_size(std::string_view text);
/// "1.23 GB", "512 MB", "64.0 KB", "17 B": decimal units, three significant digits.
std::string format_bytes(std::int64_t bytes);

/// Freed blocks of 64 KiB and more are kept for reuse (a step allocates the same sizes every
/// time, and fresh memory costs a page fault per 4 KiB). They count in no tracker. At most
/// RUDA_CACHE_BYTES (default 1 GiB; 0 disables the cache) are kept; sanitizer builds keep none.
/// When full, the blocks of the sizes used longest ago make room for the block being freed.
std::int64_t cached_bytes();
/// Returns every cached block to the system.
void release_cached();

/// While alive, allocations on this thread are charged to a fresh tracker, to the trackers of
/// the scopes it is nested in, and to the process's. stats() reads this scope's own; a scope
/// opened inside a rank's (to measure a section) still counts toward the rank's figures and limit.
/// Scopes end in the reverse order of their making, on their thread, as locks do; one that ends
/// out of order or on another thread is skipped from then on (the thread goes on in the nearest
/// open scope around it).
class Scope {
 public:
  Scope();
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  Stats stats() const;

 private:
  std::shared_ptr<Tracker> tracker_;
  std::shared_ptr<Tracker> previous_;
};

}  // namespace ruda::memory

namespace ruda {
RUDA_DECLARE_THREAD_FLAG(memory::LimitSuspended)
}  // namespace ruda
