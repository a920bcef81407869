// A small MPI program whose ranks fail on purpose, for the tests that a failing rank ends the
// whole job with a non-zero exit instead of a hang (see check_mpi_exit.cmake).
//   ok      every rank runs 5 all_gathers and exits 0
//   throw   rank 1 throws before its third all_gather, while the others wait in it; main runs
//           under mpi_abort_on_exception
//   unwind  the same, but the exception unwinds through the MpiEnvironment to a handler that
//           just returns 1 (the environment must not finalize, which would wait for rank 0)
//   skip    rank 1 skips the last all_gather (with the order check on) and ends normally
// The collective timeout (RUDA_COLLECTIVE_TIMEOUT set by the test): the last rank stops itself
// with SIGSTOP (or deadlocks) before its third collective, and the others must end the job:
//   stall        in a blocking all_gather
//   stall-async  in an all_gather_async waited for with Work::wait() (the progress thread)
//   stall-ring   in a reduce_scatter_async large enough for ruda's ring (point-to-point)
//   stall-check  in the order check's exchange before the all_gather
//   stall-setring  in set_ring_min_bytes (a raw MPI_Allreduce once, which no watchdog covered)
//   deadlock     the last rank blocks forever outside any collective (it still answers queries)
//   stall-settimeout  as stall, with the timeout set by set_timeout (the message names it)
// The last rank's own process stopped (SIGSTOP by a child, SIGCONT 3 s later) for longer than the
// 2 s timeout while it waits in its third collective, which rank 0 reaches late: that time is not
// the peers' to answer for (it blamed rank 0 when it resumed), so (2 ranks)
//   self-stop       rank 0 arrives 4 s late, 1 s of this rank's running time: the job completes
//   self-stop-late  rank 0 never arrives (deadlock): the message says the rank was stopped for ~3 s
// Before any watchdog exists, the last rank stops itself and the others must still end the job
// within the timeout (they waited forever):
//   stall-startup  before ruda::agree_on_startup
//   stall-create   before its MpiCommunicator is made (MPI_Comm_dup and the variables' agreement)
//   stall-init     before MPI_Init (the others wait in MPI_Init's fence)
//   stall-finalize after its last collective, before MPI_Finalize (the others wait in its fence)
// A variable the communicator reads, bad on rank 1 alone (set there before the communicator is
// made), must raise a typed error on every rank (it threw on rank 1 while the others waited in
// MPI_Comm_dup or in their first collective):
//   env-timeout  RUDA_COLLECTIVE_TIMEOUT=bogus
//   env-check    RUDA_CHECK_COLLECTIVES=bogus
// Each rank prints the error it caught and exits 3.
//   after-finalize  a collective on a communicator that outlived its MpiEnvironment: a typed
//                   error on each rank (MPI aborted the job), then a clean exit
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ruda/mpi.h>

namespace {

// Blocks the calling thread forever, as a deadlocked rank does.
[[noreturn]] void deadlock() {
  std::mutex m;
  std::condition_variable never;
  std::unique_lock lock(m);
  for (;;) never.wait(lock);
}

void sleep_ms(long ms) {
  timespec t{ms / 1000, (ms % 1000) * 1000000};
  while (::nanosleep(&t, &t) != 0) {
  }
}

// Stops this process (SIGSTOP) `after` ms from now and resumes it (SIGCONT) `stopped` ms later,
// from a child process (a stopped process cannot resume itself). The child, forked from a process
// with threads, calls only async-signal-safe functions. Returns the child's id.
pid_t stop_me_later(long after, long stopped) {
  const pid_t me = ::getpid();
  const pid_t child = ::fork();
  if (child == 0) {
    sleep_ms(after);
    ::kill(me, SIGSTOP);
    sleep_ms(stopped);
    ::kill(me, SIGCONT);
    ::_exit(0);
  }
  if (child < 0) throw std::runtime_error("fork failed");
  return child;
}

int run(const std::string& mode) {
  ruda::MpiCommunicator comm;
  comm.set_order_check(mode == "skip" || mode == "skip-caught" || mode == "stall-check");
  if (mode == "stall-settimeout") comm.set_timeout(std::chrono::seconds(2));
  const bool last = comm.rank() == comm.world_size() - 1;
  const ruda::Tensor x = ruda::ones({1024});
  for (int step = 0; step < 5; ++step) {
    if ((mode == "throw" || mode == "unwind") && comm.rank() == 1 && step == 2) {
      throw std::runtime_error("injected failure at step 2");
    }
    if ((mode == "skip" || mode == "skip-caught") && comm.rank() == 1 && step == 4) break;
    if (mode.rfind("stall", 0) == 0 && last && step == 2) std::raise(SIGSTOP);
    if (mode == "deadlock" && last && step == 2) deadlock();
    pid_t stopper = -1;
    if (mode.rfind("self-stop", 0) == 0 && step == 2) {
      if (last) {
        stopper = stop_me_later(500, 3000);
      } else if (mode == "self-stop") {
        std::this_thread::sleep_for(std::chrono::seconds(4));  // busy, not in a collective
      } else {
        deadlock();
      }
    }
    if (mode == "stall-async" && step == 2) {
      ruda::Work prefetch = comm.all_gather_async(x, {"prefetch"});
      prefetch.wait();
    } else if (mode == "stall-setring" && step == 2) {
      comm.set_ring_min_bytes(std::nullopt);  // collective too: watched like the others
    } else if (mode == "stall-ring" && step == 2) {
      // 64 Ki f32 per rank: far above the 64 KiB below which reduce_scatter is MPI's own.
      ruda::Work gradients = comm.reduce_scatter_async(ruda::ones({65536 * comm.world_size()}), {"grad"});
      gradients.wait();
    } else if (mode == "mismatch" && step == 2 && last) {
      // Another collective as #3, the order check off: a hang the timeout ends, naming both.
      (void)comm.reduce_scatter(ruda::ones({1024 * comm.world_size()}), {"step 2"});
    } else if (mode == "skip-caught") {
      // The mismatch caught and the program ending normally: its communicator's destructor must
      // not wait for the rank that left (it did, until the collective timeout).
      try {
        comm.all_gather(x, {"step " + std::to_string(step)});
      } catch (const ruda::CollectiveMismatchError& e) {
        std::fprintf(stderr, "rank %d caught: %s\n", comm.rank(), e.what());
        break;
      }
    } else {
      comm.all_gather(x, {"step " + std::to_string(step)});
    }
    if (stopper > 0) ::waitpid(stopper, nullptr, 0);
  }
  if (mode != "ok" && mode != "skip" && mode != "skip-caught")
    std::fprintf(stderr, "rank %d: the stalled collective completed\n", comm.rank());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ok";
  if (mode != "ok" && mode != "throw" && mode != "unwind" && mode != "skip" && mode != "skip-caught" &&
      mode != "stall" && mode != "stall-async" && mode != "stall-ring" && mode != "stall-check" &&
      mode != "stall-setring" && mode != "deadlock" && mode != "stall-settimeout" && mode != "env-timeout" &&
      mode != "env-check" && mode != "after-finalize" && mode != "stall-startup" && mode != "stall-create" &&
      mode != "stall-init" && mode != "stall-finalize" && mode != "self-stop" && mode != "self-stop-late" &&
      mode != "mismatch") {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  if (mode == "after-finalize") {
    std::unique_ptr<ruda::MpiCommunicator> comm;
    {
      ruda::MpiEnvironment mpi(argc, argv);
      comm = std::make_unique<ruda::MpiCommunicator>();
      comm->all_reduce(ruda::ones({2}));
    }
    try {
      comm->all_reduce(ruda::ones({2}));
      std::fprintf(stderr, "no error after finalize\n");
      return 1;
    } catch (const ruda::CollectiveError& e) {
      std::fprintf(stderr, "caught: %s\n", e.what());
    }
    comm.reset();
    return 0;
  }
  if (mode == "stall-init" || mode == "stall-finalize") {
    // The launcher's rank variable: MPI is not running yet.
    const char* rank_env = std::getenv("OMPI_COMM_WORLD_RANK");
    const char* size_env = std::getenv("OMPI_COMM_WORLD_SIZE");
    const bool last = rank_env && size_env && std::atoi(rank_env) == std::atoi(size_env) - 1;
    if (mode == "stall-init" && last) std::raise(SIGSTOP);
    ruda::MpiEnvironment mpi(argc, argv);
    {
      ruda::MpiCommunicator comm;
      comm.all_gather(ruda::ones({4}));
    }
    if (mode == "stall-finalize" && last) std::raise(SIGSTOP);
    return 0;
  }
  if (mode == "stall-startup" || mode == "stall-create") {
    ruda::MpiEnvironment mpi(argc, argv);
    if (mpi.world_rank() == mpi.world_size() - 1) std::raise(SIGSTOP);
    if (mode == "stall-startup") (void)ruda::agree_on_startup("");
    ruda::MpiCommunicator comm;
    std::fprintf(stderr, "rank %d: the start-up completed\n", comm.rank());
    return 0;
  }
  if (mode.rfind("env-", 0) == 0) {
    ruda::MpiEnvironment mpi(argc, argv);
    if (mpi.world_rank() == 1) {
      ::setenv(mode == "env-timeout" ? "RUDA_COLLECTIVE_TIMEOUT" : "RUDA_CHECK_COLLECTIVES", "bogus", 1);
    }
    try {
      ruda::MpiCommunicator comm;
      comm.all_gather(ruda::ones({4}));
      std::fprintf(stderr, "rank %d: no error\n", mpi.world_rank());
      return 0;
    } catch (const ruda::ArgumentError& e) {
      std::fprintf(stderr, "caught: %s\n", e.what());
      return 3;
    }
  }
  if (mode == "unwind") {
    try {
      ruda::MpiEnvironment mpi(argc, argv);
      return run(mode);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "caught after unwinding: %s\n", e.what());
      return 1;
    }
  }
  ruda::MpiEnvironment mpi(argc, argv);
  return ruda::mpi_abort_on_exception([&] { return run(mode); });
}
