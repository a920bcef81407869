// A flag that a scope raises on its own thread: the one mechanism behind DeferredInit,
// memory::LimitSuspended and nn's RetainGathered.
#pragma once

namespace ruda {

/// While an instance is alive, active() is true on the thread that made it. Scopes nest: the
/// destructor restores the state the constructor found. Each Tag has a flag of its own; a scope
/// class names itself as the tag: `class DeferredInit : public ThreadFlagScope<DeferredInit> {};`.
template <class Tag>
class ThreadFlagScope {
 public:
  ThreadFlagScope() noexcept : previous_(flag()) { flag() = true; }
  ~ThreadFlagScope() { flag() = previous_; }
  ThreadFlagScope(const ThreadFlagScope&) = delete;
  ThreadFlagScope& operator=(const ThreadFlagScope&) = delete;

  /// Whether a scope of this kind is alive on the calling thread.
  static bool active() noexcept { return flag(); }

 private:
  static bool& flag() noexcept {
    thread_local bool raised = false;
    return raised;
  }
  bool previous_;
};

}  // namespace ruda
