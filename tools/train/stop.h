// ruda-train's graceful stop. A job scheduler ends a job with SIGTERM (SLURM at the time limit, on
// preemption or scancel; Kubernetes on eviction) and a user with Ctrl-C (SIGINT); SIGUSR1 is the
// one mpiexec forwards to the ranks without killing them after (and SLURM's --signal=USR1@T sends
// before the time limit). With a checkpoint directory, such a signal during the steps no longer
// loses the steps since the last checkpoint: the rank records it, the ranks agree at the end of
// the step (one all-reduce a step), every rank saves that step, and the run ends with exit status
// 128 + the signal, as a process the signal ended would. A second signal ends the process at once,
// as before.
//
// The signals are taken by a thread of their own (watch_stop_signals), blocked in every other: a
// signal handled on a thread inside oneDNN 2.6's f32 gemm:jit kernel corrupts the heap, because
// that kernel points its stack pointer at a heap workspace when K > 84 and the signal's frame is
// written below it (oneDNN issue #4845, fixed in 3.11; 3 of ~45 runs stopped by SIGTERM aborted
// in free() with "munmap_chunk(): invalid pointer").
#pragma once

#include <string>

namespace ruda::train {

/// Blocks SIGINT, SIGTERM and SIGUSR1 in the calling thread and in every thread started after it
/// (they inherit the mask), and starts the thread that waits for them: without a StopSignals, or
/// at the second signal, it ends the process by the signal's default action. Call it first in
/// main(), before any other thread exists (OpenMP's, MPI's, emulated ranks'). Idempotent.
void watch_stop_signals();

/// While one exists (emulated ranks each hold one), the first SIGINT, SIGTERM or SIGUSR1 is
/// recorded instead of ending the process (watch_stop_signals must have run). The last to go
/// ends the process by a signal received that the run did not act on (one that came after the
/// last step's check), as it would have. A signal the process ignores (a shell's background job
/// ignores SIGINT) stays ignored.
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

/// Sends `signal` to this process, as one from outside arrives, and returns once it is recorded
/// (or the process ends by it): the test hook's raise.
void send_for_test(int signal);

/// Test hook: RUDA_TEST_RAISE=TERM@N (or INT@N, USR1@N) raises the signal in the last rank during
/// step N (counted from 1), as if it came from outside; TERM@end just after the last step's check.
/// signal 0 when unset; a malformed value is an error.
struct RaiseForTest {
  int signal = 0;
  long long step = 0;  // -1: @end
};
RaiseForTest raise_for_test();

}  // namespace ruda::train
