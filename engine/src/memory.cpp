#include <cstdlib>
#include <new>

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

Storage::Storage(std::size_t size) : bytes(size), tracker(memory::current_tracker()) {
  // 64-byte alignment suits AVX-512 loads and oneDNN; aligned_alloc wants a multiple of it.
  const std::size_t rounded = (size + 63) / 64 * 64;
  data = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!data) throw std::bad_alloc();
  memory::process_tracker().add(static_cast<std::int64_t>(size));
  if (tracker) tracker->add(static_cast<std::int64_t>(size));
}

Storage::~Storage() {
  std::free(data);
  memory::process_tracker().remove(static_cast<std::int64_t>(bytes));
  if (tracker) tracker->remove(static_cast<std::int64_t>(bytes));
}

}  // namespace ruda::detail
