// How gathers behave while a checkpointed block recomputes its forward (private to nn).
#pragma once

namespace ruda::nn {

/// While alive on this thread, gathered weights keep their value for backward (as with
/// CheckpointStrategy::retain) whatever the parameter's policy: a block recomputed by checkpoint()
/// runs its backward right after, so gathering a third time would only cost a collective.
class RetainGathered {
 public:
  RetainGathered() noexcept;
  ~RetainGathered();
  RetainGathered(const RetainGathered&) = delete;
  RetainGathered& operator=(const RetainGathered&) = delete;
  static bool active() noexcept;

 private:
  bool previous_;
};

}  // namespace ruda::nn
