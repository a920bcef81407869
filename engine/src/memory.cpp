#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "internal.h"

namespace ruda::memory {

bool Tracker::try_reserve(std::int64_t bytes, std::int64_t limit) noexcept {
  std::int64_t live = live_.load(std::memory_order_relaxed);
  do {
    if (limit > 0 && bytes > limit - live) return false;
  } while (!live_.compare_exchange_weak(live, live + bytes, std::memory_order_relaxed));
  return true;
}
void Tracker::commit() noexcept {
  allocations_.fetch_add(1, std::memory_order_relaxed);
  const std::int64_t live = live_.load(std::memory_order_relaxed);
  std::int64_t peak = peak_.load(std::memory_order_relaxed);
  while (live > peak && !peak_.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}
void Tracker::remove(std::int64_t bytes) noexcept { live_.fetch_sub(bytes, std::memory_order_relaxed); }
Stats Tracker::stats() const noexcept {
  return Stats{live_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
               allocations_.load(std::memory_order_relaxed)};
}
void Tracker::reset_peak() noexcept { peak_.store(live_.load(std::memory_order_relaxed), std::memory_order_relaxed); }

Tracker& process_tracker() {
  static Tracker tracker;
  return tracker;
}

namespace {
thread_local std::shared_ptr<Tracker> t_current;
}

// The thread's tracker. A scope that ended out of order (before one opened inside it) or on
// another thread than its own left it on its tracker; from then on the nearest open scope's.
const std::shared_ptr<Tracker>& current_tracker() {
  if (t_current && t_current->closed()) t_current = Tracker::open(t_current);
  return t_current;
}

Stats stats() {
  const std::shared_ptr<Tracker>& current = current_tracker();
  return current ? current->stats() : process_tracker().stats();
}
Stats process_stats() { return process_tracker().stats(); }
void reset_peak() {
  if (const std::shared_ptr<Tracker>& current = current_tracker()) current->reset_peak();
  process_tracker().reset_peak();
}

namespace {
// RUDA_MEMORY_LIMIT, parsed once. A text that is no size is an error naming the variable at every
// allocation until set_limit() replaces it (the limit's initializer threw before, so it was parsed
// again at each call, the message did not name the variable, and set_limit could not recover).
struct EnvLimit {
  std::int64_t bytes = 0;
  std::string error;
};
const EnvLimit& env_limit() {
  static const EnvLimit parsed = [] {
    EnvLimit e;
    const char* env = std::getenv("RUDA_MEMORY_LIMIT");
    if (!env || !*env) return e;
    try {
      e.bytes = parse_size(env);
    } catch (const ArgumentError& x) {
      e.error = std::string("RUDA_MEMORY_LIMIT: ") + x.what() + " (set a size such as 512MB, or unset it)";
    }
    return e;
  }();
  return parsed;
}
std::atomic<std::int64_t> g_limit{0};
std::atomic<bool> g_limit_set{false};                          // set_limit() called: the environment no longer applies
std::atomic<const char*> g_limit_source{"memory::set_limit"};  // set_limit's source argument
}  // namespace

// Where the limit in force came from, for the error of an allocation past it.
static const char* limit_source() {
  return g_limit_set.load(std::memory_order_acquire) ? g_limit_source.load(std::memory_order_relaxed)
                                                     : "RUDA_MEMORY_LIMIT";
}

std::int64_t limit() {
  if (g_limit_set.load(std::memory_order_acquire)) return g_limit.load(std::memory_order_relaxed);
  const EnvLimit& e = env_limit();
  if (!e.error.empty()) throw ArgumentError(e.error);
  return e.bytes;
}
void set_limit(std::int64_t bytes, const char* source) {
  if (bytes < 0) fail<ArgumentError>("memory::set_limit", "limit must be 0 (none) or positive, got ", bytes);
  g_limit.store(bytes, std::memory_order_relaxed);
  g_limit_source.store(source && *source ? source : "memory::set_limit", std::memory_order_relaxed);
  g_limit_set.store(true, std::memory_order_release);
}

std::int64_t parse_size(std::string_view text) {
  const std::string s(text);
  auto bad = [&]() -> std::int64_t {
    fail<ArgumentError>("memory size", "'", detail::shown_nul(s), "' is not a size (examples: 512MB, 2GiB, 1048576)");
  };
  // Digits with at most one decimal point, then a unit: not stod's whole grammar, which read
  // "0x10" as 16 and "1e3" as 1000 (the collective timeout's parser refuses them too).
  std::size_t used = 0;
  while (used < s.size() && (std::isdigit(static_cast<unsigned char>(s[used])) || s[used] == '.')) ++used;
  const std::string digits = s.substr(0, used);
  if (digits.empty() || !std::isdigit(static_cast<unsigned char>(digits[0])) ||
      std::count(digits.begin(), digits.end(), '.') > 1) {
    return bad();
  }
  const double number = std::strtod(digits.c_str(), nullptr);
  auto too_large = [&]() -> std::int64_t {
    fail<ArgumentError>("memory size", "'", s, "' is more bytes than an int64 holds");
  };
  std::string unit;
  for (char c : s.substr(used)) {
    if (c != ' ') unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  static const std::pair<const char*, double> units[] = {{"", 1},
                                                         {"b", 1},
                                                         {"k", 1e3},
                                                         {"kb", 1e3},
                                                         {"m", 1e6},
                                                         {"mb", 1e6},
                                                         {"g", 1e9},
                                                         {"gb", 1e9},
                                                         {"t", 1e12},
                                                         {"tb", 1e12},
                                                         {"kib", 1024.0},
                                                         {"mib", 1048576.0},
                                                         {"gib", 1073741824.0},
                                                         {"tib", 1099511627776.0}};
  if ((unit.empty() || unit == "b") && digits.find('.') == std::string::npos) {
    // A whole number of bytes, exactly (through a double, 2^63 - 1 rounded up past int64).
    std::int64_t bytes = 0;
    for (const char c : digits) {
      if (__builtin_mul_overflow(bytes, std::int64_t{10}, &bytes) ||
          __builtin_add_overflow(bytes, std::int64_t{c - '0'}, &bytes)) {
        return too_large();
      }
    }
    return bytes;
  }
  // A byte count with a fraction ("0.4", "1.5B") is no size: rounded, "0.4" became 0, which is no
  // limit at all, and "1.5" 2 bytes. With a unit the fraction is of the unit ("1.5GB").
  if (unit.empty() || unit == "b") {
    fail<ArgumentError>("memory size", "'", s, "' is not a whole number of bytes (examples: 512MB, 1.5GB, 1048576)");
  }
  for (const auto& [name, scale] : units) {
    if (unit != name) continue;
    const double bytes = std::round(number * scale);
    if (bytes >= 9223372036854775808.0) return too_large();  // 2^63
    if (bytes == 0 && number > 0) {
      fail<ArgumentError>("memory size", "'", s, "' is less than one byte (0, no limit, is written 0)");
    }
    return static_cast<std::int64_t>(bytes);
  }
  return bad();
}

std::string format_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  char buf[32];
  if (bytes > -1000 && bytes < 1000) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
    return buf;
  }
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::abs(value) >= 1000 && unit < 5) {
    value /= 1000;
    ++unit;
  }
  // Three significant digits, rounded before printing: where the rounding reaches the next unit
  // (999999 B printed as "1000 KB") the next unit is taken, and where it reaches the next power of
  // ten (99.95 KB) the decimals follow it ("100 KB", not "100.0 KB").
  auto decimals_for = [](double v) { return std::abs(v) >= 100 ? 0 : std::abs(v) >= 10 ? 1 : 2; };
  int decimals = decimals_for(value);
  for (;;) {
    const double scale = decimals == 0 ? 1 : decimals == 1 ? 10 : 100;
    const double rounded = std::round(value * scale) / scale;
    if (std::abs(rounded) >= 1000 && unit < 5) {
      value = rounded / 1000;
      ++unit;
      decimals = decimals_for(value);
      continue;
    }
    value = rounded;
    decimals = decimals_for(rounded);
    break;
  }
  std::snprintf(buf, sizeof buf, "%.*f %s", decimals, value, units[unit]);
  return buf;
}

Scope::Scope() : tracker_(std::make_shared<Tracker>()), previous_(current_tracker()) {
  tracker_->set_parent(previous_);
  t_current = tracker_;
}
// Out of order (a scope opened inside this one is still open) or on another thread, the thread's
// current scope stays; its allocations skip this closed one from then on. Restoring `previous_`
// then had left the thread on a tracker nobody read, its limit no longer applied (a scope
// opened inside a rank's, ended after the rank's).
Scope::~Scope() {
  tracker_->close();
  if (t_current == tracker_) t_current = Tracker::open(previous_);
}
Stats Scope::stats() const { return tracker_->stats(); }

}  // namespace ruda::memory

namespace ruda::detail {

// Large blocks are kept for reuse instead of being returned to the system: a training step
// allocates the same sizes every time, and each first touch of fresh memory costs a page fault
// (about 17 us per 4 KiB page in the VMs this was measured on, so ~70 ms for a fresh 16 MiB
// tensor). Sizes round up to classes a quarter of a power of two apart (at most 25% slack).
// Sanitizer builds skip the cache and allocate the exact size, so that use-after-free and reads
// past a storage's last byte stay visible.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
constexpr bool kCacheByDefault = !kSanitized;
constexpr std::size_t kCacheMin = std::size_t{1} << 16;

class BlockCache {
 public:
  BlockCache() {
    limit_ = kCacheByDefault ? std::size_t{1} << 30 : 0;  // idle bytes kept at most
    // A size as RUDA_MEMORY_LIMIT takes one (strtoull read "1GB" as 1 byte and "-1" as unlimited);
    // a text that is none keeps the default, with a warning (this runs inside an allocation).
    if (const char* env = std::getenv("RUDA_CACHE_BYTES"); env && *env) {
      try {
        limit_ = static_cast<std::size_t>(memory::parse_size(env));
      } catch (const ArgumentError& e) {
        std::fprintf(stderr, "ruda: ignoring RUDA_CACHE_BYTES: %s\n", e.what());
      }
    }
  }
  ~BlockCache() {
    for (auto& [size, c] : free_) {
      for (void* p : c.blocks) std::free(p);
    }
  }
  static std::size_t size_class(std::size_t bytes) {
    if (kSanitized) return bytes;
    if (bytes < kCacheMin) return (bytes + 63) / 64 * 64;
    std::size_t power = kCacheMin;
    while (power * 2 <= bytes) power *= 2;
    const std::size_t step = power / 4;
    return (bytes + step - 1) / step * step;
  }
  void* take(std::size_t size) {
    if (size >= kCacheMin && limit_ > 0) {
      std::lock_guard lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end()) {
        it->second.used = ++clock_;
        if (!it->second.blocks.empty()) {
          void* p = it->second.blocks.back();
          it->second.blocks.pop_back();
          idle_ -= size;
          return p;
        }
      }
    }
    void* p = allocate(size);
    if (!p) {
      release_all();  // cached blocks may be what stands between us and the allocation
      p = allocate(size);
      if (!p) throw std::bad_alloc();
    }
    return p;
  }
  void give(void* p, std::size_t size) {
    if (size >= kCacheMin && size <= limit_) {
      std::lock_guard lock(mutex_);
      SizeClass& mine = free_[size];
      mine.used = ++clock_;
      // Full: the blocks of the sizes used longest ago go, not this one. Dropping the newcomer
      // instead left a cache filled once by other sizes (an evaluation's, or a large first
      // model's, in the same process) holding them for good, and every block of the sizes in use
      // now was allocated and page-faulted afresh on every step: the default GPT's step ran at
      // 0.78 of the GEMM rate after the attention benchmark in one process, 0.84 alone.
      while (idle_ + size > limit_) {
        SizeClass* oldest = nullptr;
        std::size_t oldest_size = 0;
        for (auto& [class_size, c] : free_) {
          if (&c != &mine && !c.blocks.empty() && (!oldest || c.used < oldest->used)) {
            oldest = &c;
            oldest_size = class_size;
          }
        }
        if (!oldest) break;
        std::free(oldest->blocks.back());
        oldest->blocks.pop_back();
        idle_ -= oldest_size;
      }
      if (idle_ + size <= limit_) {
        mine.blocks.push_back(p);
        idle_ += size;
        return;
      }
    }
    std::free(p);
  }
  void release_all() {
    std::lock_guard lock(mutex_);
    for (auto& [size, c] : free_) {
      for (void* p : c.blocks) std::free(p);
      c.blocks.clear();
    }
    idle_ = 0;
  }
  std::size_t idle() {
    std::lock_guard lock(mutex_);
    return idle_;
  }

 private:
  // posix_memalign, unlike aligned_alloc, takes sizes that are not a multiple of the alignment.
  static void* allocate(std::size_t size) {
    void* p = nullptr;
    return ::posix_memalign(&p, 64, size == 0 ? 1 : size) == 0 ? p : nullptr;
  }

  // The idle blocks of one size, and when the size was last taken or given (clock_'s count).
  struct SizeClass {
    std::vector<void*> blocks;
    std::uint64_t used = 0;
  };
  std::mutex mutex_;
  std::unordered_map<std::size_t, SizeClass> free_;
  std::uint64_t clock_ = 0;
  std::size_t idle_ = 0;
  std::size_t limit_;
};

BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();  // never destroyed: storages may outlive statics
  return *cache;
}

namespace {
[[noreturn]] void out_of_memory(const char* op, const Shape& shape, DType dtype, std::int64_t requested,
                                const memory::Tracker& rank, std::int64_t limit, bool system) {
  const std::int64_t live = rank.stats().live_bytes;
  // A thread in no memory::Scope is charged to (and limited by) the whole process: say so, not
  // "this rank", whose bytes a plain user thread does not hold.
  const bool process = &rank == &memory::process_tracker();
  const std::string what =
      concat(dtype_name(dtype), " ", shape, " needs ", memory::format_bytes(requested), " (", requested,
             " bytes) with ", memory::format_bytes(live),
             process ? " live in this process (this thread is in no memory::Scope)" : " live on this rank");
  if (system) {
    fail<OutOfMemoryError>(op, "out of memory: ", what, ", and the system refused it",
                           limit > 0 ? concat(" (limit ", memory::format_bytes(limit), ")") : std::string());
  }
  fail<OutOfMemoryError>(op, "out of memory: ", what, ", over ", process ? "the" : "this rank's", " limit of ",
                         memory::format_bytes(limit), " (", limit, " bytes; ", memory::limit_source(), ")");
}

// Removes `bytes` from `tracker` and the trackers of the scopes it is nested in, up to `end`.
void uncharge(memory::Tracker* tracker, std::int64_t bytes, const memory::Tracker* end = nullptr) noexcept {
  for (memory::Tracker* t = tracker; t != end; t = t->parent()) t->remove(bytes);
}

std::int64_t limit_in_force() { return memory::LimitSuspended::active() ? 0 : memory::limit(); }
}  // namespace

Charge::Charge(Reserve, std::size_t bytes, const char* op, const Shape& shape, DType dtype)
    : bytes_(static_cast<std::int64_t>(bytes)), tracker_(memory::current_tracker()) {
  // The calling thread's tracker and those of the scopes it is nested in, each within the limit;
  // then the process's (a thread in no scope is charged to it alone).
  const std::int64_t limit = limit_in_force();
  memory::Tracker& rank = tracker_ ? *tracker_ : memory::process_tracker();
  for (memory::Tracker* t = &rank; t; t = t->parent()) {
    if (!t->try_reserve(bytes_, limit)) {
      uncharge(&rank, bytes_, t);
      out_of_memory(op, shape, dtype, bytes_, *t, limit, false);
    }
  }
  if (tracker_) (void)memory::process_tracker().try_reserve(bytes_, 0);  // no limit: always taken
}

Charge::Charge(std::size_t bytes, const char* op, const Shape& shape, DType dtype)
    : Charge(Reserve{}, bytes, op, shape, dtype) {
  commit();
}

void Charge::commit() noexcept {
  for (memory::Tracker* t = tracker_ ? tracker_.get() : &memory::process_tracker(); t; t = t->parent()) t->commit();
  if (tracker_) memory::process_tracker().commit();
}

void Charge::release() noexcept {
  const std::int64_t bytes = std::exchange(bytes_, 0);
  memory::process_tracker().remove(bytes);
  if (tracker_) uncharge(tracker_.get(), bytes);
}

Charge::~Charge() { release(); }

Storage::Storage(std::size_t size, const char* op, const Shape& shape, DType dtype)
    : bytes(size), charge(Charge::Reserve{}, size, op, shape, dtype) {
  // Charged first, so that a refused allocation never touches the system allocator.
  try {
    // 64-byte alignment suits AVX-512 loads and oneDNN.
    data = block_cache().take(BlockCache::size_class(size));
  } catch (const std::bad_alloc&) {
    charge.release();
    memory::Tracker& rank = charge.tracker_ ? *charge.tracker_ : memory::process_tracker();
    out_of_memory(op, shape, dtype, static_cast<std::int64_t>(size), rank, limit_in_force(), true);
  }
  // Only now is it an allocation: a refused one (by a scope's limit, or by the system) had been
  // charged to the peaks and counts of the trackers that let it through, and a caller who caught
  // the OutOfMemoryError to retry smaller read a peak of bytes that never existed.
  charge.commit();
}

Storage::~Storage() { block_cache().give(data, BlockCache::size_class(bytes)); }

}  // namespace ruda::detail

namespace ruda::memory {
std::int64_t cached_bytes() { return static_cast<std::int64_t>(detail::block_cache().idle()); }
void release_cached() { detail::block_cache().release_all(); }
}  // namespace ruda::memory

namespace ruda {
RUDA_DEFINE_THREAD_FLAG(memory::LimitSuspended)
}  // namespace ruda
