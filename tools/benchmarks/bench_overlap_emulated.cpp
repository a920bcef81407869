// Suite "overlap-emulated" of ruda-bench (overlap.h says what it measures): the same rows as the
// MPI suite "overlap", on 2 emulated ranks (threads, one intra-op thread each) joined by the link
// model, whose collectives sleep for the time the link would need. The link rates are set from
// this machine's compute time, so that communication takes about 0.5, 1 and 2 times compute: on
// any CPU the three rows are below, near and above it (--quick: the middle one). tools/bench
// --suite overlap runs it too.
#include <ruda/collectives.h>

#include <string>
#include <vector>

#include "overlap.h"

namespace ruda::bench {
namespace {

constexpr int kWorld = 2;

EmulatedOptions options(LinkModel link = {}) {
  EmulatedOptions o;
  o.threads_per_rank = 1;
  o.check_order = false;
  o.link = link;
  return o;
}

void run(Context& ctx) {
  // One backend is enough here: the fastest built (onednn where built), as ruda-train would use.
  if (ctx.backend != available_backends().back()) return;
  for (overlap::Maker make : overlap::models()) {
    // The bytes one rank's link carries in a step (each group gathered once or twice, reduced
    // once, as a ring sends them) and the dense step's time, without a link.
    double compute_seconds = 0, bytes_per_step = 0;
    run_ranks(
        kWorld,
        [&](Communicator& comm) {
          const Stats compute = overlap::train_step(ctx, comm, make, nullptr).seconds;
          if (comm.rank() != 0) return;
          compute_seconds = compute.median;
          const overlap::Model m = make(kWorld, 0);
          const std::vector<std::int64_t> parts = overlap::group_parts(m, kWorld);
          const std::vector<bool> again = overlap::gathered_in_backward(m, parts.size());
          for (std::size_t g = 0; g < parts.size(); ++g)
            bytes_per_step += (again[g] ? 3.0 : 2.0) * (kWorld - 1) * static_cast<double>(parts[g]) * 4;
        },
        options());
    // --quick (a smoke run): the middle row only.
    const std::vector<double> shares = ctx.quick ? std::vector<double>{1.0} : std::vector<double>{0.5, 1.0, 2.0};
    for (const double share : shares) {
      LinkModel link;
      link.bytes_per_second = bytes_per_step / (share * compute_seconds);
      const std::string where =
          "emulated " + link.describe() + " link (communication ~" + std::to_string(share).substr(0, 3) + "x compute)";
      run_ranks(
          kWorld, [&](Communicator& comm) { overlap::measure_model(ctx, comm, make, where); }, options(link));
    }
  }
}

const bool registered = register_suite("overlap-emulated", run);

}  // namespace
}  // namespace ruda::bench
