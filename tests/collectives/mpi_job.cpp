// A small MPI program whose ranks fail on purpose, for the tests that a failing rank ends the
// whole job with a non-zero exit instead of a hang (see check_mpi_exit.cmake).
//   ok      every rank runs 5 all_gathers and exits 0
//   throw   rank 1 throws before its third all_gather, while the others wait in it; main runs
//           under mpi_abort_on_exception
//   unwind  the same, but the exception unwinds through the MpiEnvironment to a handler that
//           just returns 1 (the environment must not finalize, which would wait for rank 0)
//   skip    rank 1 skips the last all_gather (with the order check on) and ends normally
#include <cstdio>
#include <stdexcept>
#include <string>

#include <ruda/mpi.h>

namespace {

int run(const std::string& mode) {
  ruda::MpiCommunicator comm;
  comm.set_order_check(mode == "skip");
  const ruda::Tensor x = ruda::ones({1024});
  for (int step = 0; step < 5; ++step) {
    if ((mode == "throw" || mode == "unwind") && comm.rank() == 1 && step == 2) {
      throw std::runtime_error("injected failure at step 2");
    }
    if (mode == "skip" && comm.rank() == 1 && step == 4) break;
    comm.all_gather(x, {"step " + std::to_string(step)});
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ok";
  if (mode != "ok" && mode != "throw" && mode != "unwind" && mode != "skip") {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
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
