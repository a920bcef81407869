#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "internal.h"

namespace ruda::memory {

void Tracker::add(std::int64_t bytes) noexcept {
  const std::int64_t live = live_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  allocations_.fetch_add(1, std::memory_order_relaxed);
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

const std::shared_ptr<Tracker>& current_tracker() { return t_current; }

Stats stats() { return t_current ? t_current->stats() : process_tracker().stats(); }
Stats process_stats() { return process_tracker().stats(); }
void reset_peak() {
  if (t_current) t_current->reset_peak();
  process_tracker().reset_peak();
}

Scope::Scope() : tracker_(std::make_shared<Tracker>()), previous_(t_current) { t_current = tracker_; }
Scope::~Scope() { t_current = previous_; }
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
    if (const char* env = std::getenv("RUDA_CACHE_BYTES"); env && *env) limit_ = std::strtoull(env, nullptr, 10);
  }
  ~BlockCache() {
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) std::free(p);
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
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        idle_ -= size;
        return p;
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
    if (size >= kCacheMin && limit_ > 0) {
      std::lock_guard lock(mutex_);
      if (idle_ + size <= limit_) {
        free_[size].push_back(p);
        idle_ += size;
        return;
      }
    }
    std::free(p);
  }
  void release_all() {
    std::lock_guard lock(mutex_);
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) std::free(p);
      blocks.clear();
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

  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::size_t idle_ = 0;
  std::size_t limit_;
};

BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();  // never destroyed: storages may outlive statics
  return *cache;
}

Storage::Storage(std::size_t size) : bytes(size), tracker(memory::current_tracker()) {
  // 64-byte alignment suits AVX-512 loads and oneDNN.
  data = block_cache().take(BlockCache::size_class(size));
  memory::process_tracker().add(static_cast<std::int64_t>(size));
  if (tracker) tracker->add(static_cast<std::int64_t>(size));
}

Storage::~Storage() {
  block_cache().give(data, BlockCache::size_class(bytes));
  memory::process_tracker().remove(static_cast<std::int64_t>(bytes));
  if (tracker) tracker->remove(static_cast<std::int64_t>(bytes));
}

}  // namespace ruda::detail

namespace ruda::memory {
std::int64_t cached_bytes() { return static_cast<std::int64_t>(detail::block_cache().idle()); }
void release_cached() { detail::block_cache().release_all(); }
}  // namespace ruda::memory
