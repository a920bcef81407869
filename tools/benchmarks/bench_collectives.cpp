// Suite "collectives": bus bandwidth of emulated ranks (threads in this process), all_gather and
// reduce_scatter at 2 and 4 ranks for 4 KiB ... 64 MiB in total, against memcpy of the same
// total bytes on one thread in the same run.
//
// Bus bandwidth = (n - 1) / n * total bytes / time, for both collectives (as nccl-tests counts
// it). The sweep uses the *_into forms, on buffers allocated once, so it measures the collective;
// one more row per world shows the allocating all_gather, whose fresh result pays page faults.
#include <cstring>
#include <string>
#include <vector>

#include <ruda/backend.h>
#include <ruda/collectives.h>
#include <ruda/tensor.h>

#include "bench.h"

namespace ruda::bench {
namespace {

Stats memcpy_rate(const Context& ctx, std::int64_t bytes) {
  std::vector<char> src(static_cast<std::size_t>(bytes), 1), dst(static_cast<std::size_t>(bytes), 0);
  const int repeats = repeats_for(bytes);
  const Stats seconds = measure(ctx, [&] {
    for (int i = 0; i < repeats; ++i) std::memcpy(dst.data(), src.data(), src.size());
  });
  return rate(seconds, 1e-9 * static_cast<double>(bytes) * repeats);
}

void run(Context& ctx) {
  // Collectives move host memory the same way whatever the backend: measure once.
  if (ctx.backend != available_backends().front()) return;
  for (int n : {2, 4}) {
    EmulatedOptions options;
    options.threads_per_rank = 1;  // copies run on the rank threads themselves
    options.check_order = false;
    for (std::int64_t total : collective_totals(ctx)) {
      const std::int64_t count = total / 4 / n;  // f32 elements per rank
      const int repeats = repeats_for(total);
      Stats gather, scatter, gather_alloc;
      run_ranks(
          n,
          [&](Communicator& comm) {
            const Tensor local = ones({count});
            const Tensor gathered = zeros({count * n});
            const Tensor full = ones({count * n});
            const Tensor piece = zeros({count});
            const Stats g = measure(ctx, [&] {
              for (int i = 0; i < repeats; ++i) comm.all_gather_into(gathered, local);
            });
            const Stats s = measure(ctx, [&] {
              for (int i = 0; i < repeats; ++i) comm.reduce_scatter_into(piece, full);
            });
            Stats a;
            if (total == (16 << 20)) {
              a = measure(ctx, [&] {
                for (int i = 0; i < repeats; ++i) (void)comm.all_gather(local);
              });
            }
            if (comm.rank() == 0) {
              gather = g;
              scatter = s;
              gather_alloc = a;
            }
          },
          options);
      const Stats copy = memcpy_rate(ctx, total);
      const double bus_gb = 1e-9 * static_cast<double>(total) * (n - 1) / n * repeats;
      const std::string suffix = " n=" + std::to_string(n) + " " + size_name(total);
      ctx.report(Result{"collectives", "emulated all_gather" + suffix, ctx.backend, "GB/s", rate(gather, bus_gb), copy,
                        "memcpy"});
      ctx.report(Result{"collectives", "emulated reduce_scatter" + suffix, ctx.backend, "GB/s", rate(scatter, bus_gb),
                        copy, "memcpy"});
      if (total == (16 << 20)) {
        ctx.report(Result{"collectives", "emulated all_gather (allocating)" + suffix, ctx.backend, "GB/s",
                          rate(gather_alloc, bus_gb), copy, "memcpy"});
      }
    }
  }
}

const bool registered = register_suite("collectives", run);

}  // namespace
}  // namespace ruda::bench
