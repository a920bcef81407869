// One thread that runs tasks in the order they were submitted: the MPI communicator's
// non-blocking collectives, which every rank starts in the same order and which must therefore
// run in it. Internal; it knows nothing of MPI, so it lives in ruda_collectives, where the
// ThreadSanitizer build (which has no MPI) tests it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace ruda::collectives_detail {

class ProgressThread {
 public:
  /// When a task completed (for the traffic figures), or its exception.
  using Done = std::shared_future<std::chrono::steady_clock::time_point>;

  ProgressThread() = default;
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;
  /// Runs what is queued, then stops (as stop()).
  ~ProgressThread() { stop(); }

  /// Queues `run` after every task submitted before it; the thread starts with the first task.
  /// Once a task has failed, the ones after it fail without running ("not started: ..."): the
  /// ranks may disagree on what was done, so nothing more may be sent.
  Done submit(std::function<void()> run);
  /// Whether nothing is queued or running.
  bool idle();
  /// Waits until nothing is queued or running; CollectiveError if a task has failed. With nothing
  /// submitted since the last drain (every blocking collective drains first), it takes no lock.
  void drain();
  /// Runs what is queued and joins the thread. Idempotent.
  void stop();

 private:
  struct Task {
    std::function<void()> run;
    std::promise<std::chrono::steady_clock::time_point> done;
  };
  void work();

  std::mutex mutex_;
  std::condition_variable wake_;  // the worker: a task arrived, or stop
  std::condition_variable idle_;  // drain(): the queue emptied
  std::deque<std::shared_ptr<Task>> queue_;
  bool busy_ = false, stop_ = false;
  std::string failed_;  // the error of the first task that failed, if any
  // Tasks submitted and not yet finished, and whether one failed: drain()'s lock-free fast path.
  // The worker updates both under the mutex after a task's effects (release), drain reads them
  // first (acquire), so a 0 means every task's writes (failed_ too) are visible to it.
  std::atomic<std::size_t> pending_{0};
  std::atomic<bool> has_failed_{false};
  std::thread worker_;
};

}  // namespace ruda::collectives_detail
