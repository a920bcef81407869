// The fused attention kernel's exp pass on AVX-512 (backends/eigen/exp_wide.h) against the 8-lane
// Eigen kernel it stands in for: bit for bit, outputs and sum, on every row length from 0 to 80 and
// the block lengths, with arguments from the clamps' both sides, -inf (masked keys) and 0. Where the
// wide kernel applies (an AVX2 build on an AVX-512 CPU, GCC 12's default here) the test asserts that
// it is the one exp_shifted runs; elsewhere exp_shifted is the 8-lane kernel itself.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "eigen/attention_kernel.h"
#include "helpers.h"

namespace {

using namespace ruda::kernels::attention::detail;

bool build_has_8_lanes_with_fma() {
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TEST_CASE("the attention's exp pass gives the 8-lane kernel's bits on every path") {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool wide_cpu = __builtin_cpu_supports("avx512f");
#else
  const bool wide_cpu = false;
#endif
  // The wide kernel is chosen exactly where it applies, so this test cannot pass by skipping it
  // on the CPUs it is for.
  CHECK((exp_shifted_wide() != nullptr) == (wide_cpu && build_has_8_lanes_with_fma()));
  const std::string path = exp_shifted_wide() ? "AVX-512 (16 lanes)" : "the build's own vectors";
  MESSAGE("exp pass: " << path);

  std::mt19937 gen(7);
  std::uniform_real_distribution<float> wide_range(-110.0f, 4.0f), near_zero(-3.0f, 0.0f);
  const float specials[] = {-std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            -87.0f,
                            -87.6f,
                            -87.7f,
                            -88.0f,
                            -88.7f,
                            -88.723f,
                            -88.8f,
                            -103.9f,
                            -104.0f,
                            88.0f,
                            88.7f,
                            1e-30f,
                            -1e-30f};
  std::vector<std::int64_t> lengths;
  for (std::int64_t n = 0; n <= 80; ++n) lengths.push_back(n);
  for (std::int64_t n : {127, 128, 129, 255, 256, 257, 1000}) lengths.push_back(n);
  int compared = 0;
  for (const std::int64_t n : lengths) {
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<float> row(static_cast<std::size_t>(n));
      for (std::int64_t c = 0; c < n; ++c) {
        const auto i = static_cast<std::size_t>(c);
        row[i] = variant == 0 ? near_zero(gen) : variant == 1 ? wide_range(gen) : specials[c % std::size(specials)];
      }
      const float shift = variant == 2 ? 0.0f : 0.5f;
      std::vector<float> portable = row, dispatched = row;
      const float portable_sum = exp_shifted_packets(portable.data(), n, shift);
      const float dispatched_sum = exp_shifted(dispatched.data(), n, shift);
      CAPTURE(n);
      CAPTURE(variant);
      CHECK(std::bit_cast<std::uint32_t>(dispatched_sum) == std::bit_cast<std::uint32_t>(portable_sum));
      for (std::int64_t c = 0; c < n; ++c) {
        const auto i = static_cast<std::size_t>(c);
        CAPTURE(c);
        CAPTURE(row[i]);
        REQUIRE(std::bit_cast<std::uint32_t>(dispatched[i]) == std::bit_cast<std::uint32_t>(portable[i]));
        // And both are exp of the rounded argument: a few ulp in the normal range, 0 below the
        // kernel's cut-off (Eigen's fast path overflows from about 88.4 on: attention's arguments
        // are at most 0, each row shifted by its maximum).
        const float argument = row[i] - shift;
        if (argument > 88.0f) continue;
        const double exact = std::exp(static_cast<double>(argument));
        constexpr double kSmallestNormal = std::numeric_limits<float>::min();
        if (exact >= kSmallestNormal) {
          CHECK(std::abs(dispatched[i] - exact) <= 4e-7 * exact);
        } else {
          CHECK(dispatched[i] >= 0.0f);
          CHECK(dispatched[i] <= kSmallestNormal);
        }
      }
      ++compared;
    }
  }
  CHECK(compared == static_cast<int>(lengths.size()) * 3);
}
