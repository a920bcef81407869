#include "progress_thread.h"

#include <exception>

#include <ruda/collectives.h>

namespace ruda::collectives_detail {

ProgressThread::Done ProgressThread::submit(std::function<void()> run) {
  auto task = std::make_shared<Task>();
  task->run = std::move(run);
  Done done = task->done.get_future().share();
  {
    std::lock_guard lock(mutex_);
    if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
    queue_.push_back(std::move(task));
    pending_.fetch_add(1, std::memory_order_relaxed);
  }
  wake_.notify_one();
  return done;
}

void ProgressThread::work() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    std::shared_ptr<Task> task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    const std::string earlier = failed_;
    lock.unlock();
    try {
      if (!earlier.empty()) throw CollectiveError("not started: " + earlier);
      task->run();
      // What the task holds (a collective's tensors) goes before the waiter learns that it is
      // done: freed at a fixed point of the waiter's program, not whenever this thread got to it
      // (a step's peak memory, and the memory plan that measures it, moved from run to run).
      task->run = nullptr;
      task->done.set_value(std::chrono::steady_clock::now());
    } catch (...) {
      task->run = nullptr;
      std::string what = "unknown error";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      task->done.set_exception(std::current_exception());
      lock.lock();
      if (failed_.empty()) failed_ = "an earlier non-blocking collective on this communicator failed: " + what;
      has_failed_.store(true, std::memory_order_release);
      lock.unlock();
    }
    lock.lock();
    busy_ = false;
    pending_.fetch_sub(1, std::memory_order_release);
    if (queue_.empty()) idle_.notify_all();
  }
}

bool ProgressThread::idle() {
  std::lock_guard lock(mutex_);
  return queue_.empty() && !busy_;
}

void ProgressThread::drain() {
  // The fast path: nothing in flight and nothing failed (only the owning thread submits, so no
  // task can start meanwhile).
  if (pending_.load(std::memory_order_acquire) == 0 && !has_failed_.load(std::memory_order_acquire)) return;
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return queue_.empty() && !busy_; });
  if (!failed_.empty()) throw CollectiveError(failed_);
}

void ProgressThread::stop() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

}  // namespace ruda::collectives_detail
