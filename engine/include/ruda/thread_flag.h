// A flag that a scope raises on its own thread: the one mechanism behind DeferredInit,
// memory::LimitSuspended and nn's RetainGathered.
#pragma once

namespace ruda {

/// While an instance is alive, active() is true on the thread that made it. Scopes nest: the
/// destructor restores the state the constructor found. Each Tag has a flag of its own; a scope
/// class names itself as the tag: `class DeferredInit : public ThreadFlagScope<DeferredInit> {};`.
/// The flag lives in the library that defines the tag, not in this header: a thread_local defined
/// inline here gave a program or plugin built with -fvisibility=hidden a copy of its own, so its
/// DeferredInit deferred nothing and its LimitSuspended suspended nothing, without a word. A tag's
/// header declares the specialization of flag() (RUDA_DECLARE_THREAD_FLAG), one source file of its
/// library defines it (RUDA_DEFINE_THREAD_FLAG), both in namespace ruda.
template <class Tag>
class [[gnu::visibility("default")]] ThreadFlagScope {
 public:
  ThreadFlagScope() noexcept : previous_(flag()) { flag() = true; }
  ~ThreadFlagScope() { flag() = previous_; }
  ThreadFlagScope(const ThreadFlagScope&) = delete;
  ThreadFlagScope& operator=(const ThreadFlagScope&) = delete;

  /// Whether a scope of this kind is alive on the calling thread.
  static bool active() noexcept { return flag(); }

 private:
  static bool& flag() noexcept;  // RUDA_DECLARE_THREAD_FLAG / RUDA_DEFINE_THREAD_FLAG
  bool previous_;
};

}  // namespace ruda

/// In namespace ruda, after Tag's class: the declaration every user of the scope must see.
#define RUDA_DECLARE_THREAD_FLAG(Tag) \
  template <>                         \
  bool& ThreadFlagScope<Tag>::flag() noexcept;
/// In namespace ruda, in one source file of Tag's library: the flag itself.
#define RUDA_DEFINE_THREAD_FLAG(Tag)            \
  template <>                                   \
  bool& ThreadFlagScope<Tag>::flag() noexcept { \
    thread_local bool raised = false;           \
    return raised;                              \
  }
