// How gathers behave while a checkpointed block recomputes its forward (private to nn).
#pragma once

#include <ruda/thread_flag.h>

namespace ruda::nn {

/// While alive on this thread, gathered weights keep their value for backward (as with
/// CheckpointStrategy::retain) whatever the parameter's policy: a block recomputed by checkpoint()
/// runs its backward right after, so gathering a third time would only cost a collective.
class RetainGathered : public ThreadFlagScope<RetainGathered> {};

}  // namespace ruda::nn

namespace ruda {
RUDA_DECLARE_THREAD_FLAG(nn::RetainGathered)
}  // namespace ruda
