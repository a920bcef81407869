// ruda-train's job, run on every rank (emulated, MPI, or alone) with the parsed settings.
#pragma once

#include <stdexcept>
#include <string>

#include <ruda/collectives.h>

#include "config.h"

namespace ruda::train {

/// An error already reported to the user: exit non-zero without printing more.
struct Reported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// "ruda-train: error: <message>" on standard error, in one write (under mpiexec other output
/// cannot cut the line).
void print_error(const std::string& message);
/// "ruda-train: warning: <message>", likewise.
void print_warning(const std::string& message);

/// Sets up, trains and evaluates the task `cfg` names on this rank. Collective over comm. Returns
/// the exit status: 0, or 128 + the signal after a graceful stop (stop.h: every rank returns it).
/// Throws Reported for a failure already printed (a setup phase or a non-finite loss, agreed on by
/// every rank), and any other exception for a failure on this rank alone.
int run(const Config& cfg, Communicator& comm);

}  // namespace ruda::train
