// ruda-train's graceful stop. A job scheduler ends a job with SIGTERM (SLURM at the time limit, on
// preemption or scancel; Kubernetes on eviction) and a user with Ctrl-C (SIGINT); SIGUSR1 is the
// one mpiexec forwards to the ranks without killing them after (and SLURM's --signal=USR1@T sends
// before the time limit). With a checkpoint directory, such a signal during the steps no longer
// loses the steps since the last checkpoint:
// the rank records it, the ranks agree at the end of the step (one all-reduce of the signal a
// step), every rank saves that step, and the run ends with exit status 128 + the signal, as a
// process the signal ended would. The first signal restores the previous disposition, so a second
// one ends the process at once, as before.
#pragma once

#include <string>

namespace ruda::train {

/// While one exists (emulated ranks each hold one; the first installs, the last restores), SIGINT,
/// SIGTERM and SIGUSR1 are recorded instead of ending the process. A signal the process ignored when the
/// first one was made (a shell's background job ignores SIGINT) stays ignored.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// The signal received since the first of them was made, or 0.
  static int received();
};

/// "SIGINT", "SIGTERM", "SIGUSR1", or "signal N".
std::string signal_name(int signal);

/// Test hook: RUDA_TEST_RAISE=TERM@N (or INT@N, USR1@N) raises the signal in the last rank during step N
/// (counted from 1), as if it came from outside. 0 when unset; a malformed value is an error.
struct RaiseForTest {
  int signal = 0;
  long long step = 0;
};
RaiseForTest raise_for_test();

}  // namespace ruda::train
