// ruda-train's graceful stop. A job scheduler ends a job with SIGTERM (SLURM at the time limit, on
// preemption or scancel; Kubernetes on eviction) and a user with Ctrl-C (SIGINT); SIGUSR1 is the
// one mpiexec forwards to the ranks without killing them after (and SLURM's --signal=USR1@T sends
// before the time limit). With a checkpoint directory, such a signal during the steps no longer
// loses the steps since the last checkpoint: the rank records it, the ranks agree at the end of
// the step (one all-reduce a step), every rank saves that step, and the run ends with exit status
// 128 + the signal, as a process the signal ended would. The first signal restores the previous
// disposition, so a second one ends the process at once, as before.
#pragma once

#include <string>

namespace ruda::train {

/// While one exists (emulated ranks each hold one; the first installs, the last restores), SIGINT,
/// SIGTERM and SIGUSR1 are recorded instead of ending the process. The last to go restores the
/// previous dispositions and raises a signal received that the run did not act on (one that came
/// after the last step's check), so that it ends the process as it would have. A signal the
/// process ignored when the first one was made (a shell's background job ignores SIGINT) stays
/// ignored.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// The signal received since the first of them was made, or 0.
  static int received();

  /// The run acts on the signal received (it stops gracefully): the last StopSignals to go does
  /// not raise it again.
  static void acknowledge();
};

/// "SIGINT", "SIGTERM", "SIGUSR1", or "signal N".
std::string signal_name(int signal);

/// Test hook: RUDA_TEST_RAISE=TERM@N (or INT@N, USR1@N) raises the signal in the last rank during
/// step N (counted from 1), as if it came from outside; TERM@end just after the last step's check.
/// signal 0 when unset; a malformed value is an error.
struct RaiseForTest {
  int signal = 0;
  long long step = 0;  // -1: @end
};
RaiseForTest raise_for_test();

}  // namespace ruda::train
