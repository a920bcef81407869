// The fused attention's exp pass (backends/eigen/exp_wide.h) in the "attention" suite: the kernel
// exp_shifted runs (AVX-512 where the CPU has it and the build's vectors are 8 lanes wide) against
// the build's own 8-lane kernel, on the rows a T = 1024 causal block pass exponentiates (256 keys,
// scores below their row's maximum). Reads the backends' private kernel header, compiled as the
// backends compile it.
#include <cstdint>
#include <random>
#include <vector>

#include "bench.h"
#include "eigen/attention_kernel.h"

namespace ruda::bench {

void attention_exp_rows(Context& ctx) {
  using namespace ruda::kernels::attention::detail;
  constexpr std::int64_t kRow = 256, kRows = 4096;
  std::vector<float> scores(static_cast<std::size_t>(kRow * kRows)), work(scores.size());
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> below_max(-12.0f, 0.0f);
  for (float& s : scores) s = below_max(gen);
  float sink = 0;
  // In place, run after run (exp of exp ... reaches inf, which the branch-free kernels take as
  // fast as any value): the pass alone, no copy of the scores inside the timing.
  auto pass = [&](auto&& exp_row) {
    return [&, exp_row] {
      for (std::int64_t r = 0; r < kRows; ++r) sink += exp_row(work.data() + r * kRow, kRow, 0.0f);
    };
  };
  work = scores;
  const Stats dispatched =
      measure(ctx, pass([](float* row, std::int64_t n, float shift) { return exp_shifted(row, n, shift); }));
  work = scores;  // (each kernel starts from the same values)
  const Stats eight_lanes =
      measure(ctx, pass([](float* row, std::int64_t n, float shift) { return exp_shifted_packets(row, n, shift); }));
  report_time(ctx, "attention",
              std::string("f32 softmax exp pass, 4096 rows of 256 (") +
                  (exp_shifted_wide() ? "AVX-512 kernel" : "the build's own vectors") + ")",
              dispatched, eight_lanes, "the build's 8-lane kernel", "ms", 1e3);
  if (sink == 12345.0f) report_time(ctx, "attention", "unreachable", dispatched, dispatched, "", "ms", 1e3);
}

}  // namespace ruda::bench
