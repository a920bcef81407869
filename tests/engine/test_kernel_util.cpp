// The backends' kernel helpers (backends/eigen/kernel_util.h) that callers never see directly:
// parallel_for hands an exception from any chunk to its caller (an exception leaving an OpenMP
// region ends the process in std::terminate), and kernel scratch memory the system refuses is an
// OutOfMemoryError, not a std::bad_alloc that no `catch (const ruda::Error&)` sees.
#include <atomic>
#include <cstdint>
#include <string>

#include "eigen/kernel_util.h"
#include "helpers.h"

using namespace ruda;

namespace {

// Sets the intra-op thread count for a scope.
struct Threads {
  int before = num_threads();
  explicit Threads(int n) { set_num_threads(n); }
  ~Threads() { set_num_threads(before); }
};

}  // namespace

TEST_CASE("parallel_for rethrows a chunk's exception on the calling thread") {
  Threads threads(4);
  const std::int64_t total = 1 << 16;
  std::atomic<std::int64_t> covered{0};
  // Only the last chunk throws: with four threads it runs on a thread other than the caller's.
  test::check_throws<ShapeError>(
      [&] {
        kernels::parallel_for(total, 1, [&](std::int64_t begin, std::int64_t end) {
          covered += end - begin;
          if (end == total) fail<ShapeError>("chunk", "refused [", begin, ", ", end, ")");
        });
      },
      {"chunk", "refused"});
  // The other chunks ran to their end.
  CHECK(covered.load() == total);
  // Every chunk throwing: one exception arrives, of its own type.
  CHECK_THROWS_AS(kernels::parallel_for(total, 1, [](std::int64_t, std::int64_t) { throw std::bad_alloc(); }),
                  std::bad_alloc);
  // The loop still works afterwards, in parallel and inline.
  std::atomic<std::int64_t> sum{0};
  kernels::parallel_for(total, 1, [&](std::int64_t b, std::int64_t e) { sum += e - b; });
  kernels::parallel_for(10, 1 << 20, [&](std::int64_t b, std::int64_t e) { sum += e - b; });
  CHECK(sum.load() == total + 10);
}

TEST_CASE("kernel scratch the system refuses is an OutOfMemoryError") {
  kernels::Scratch<float> scratch;
  // 4 EiB: more than any machine maps, so operator new throws std::bad_alloc.
  test::check_throws<OutOfMemoryError>([&] { scratch.resize(std::size_t{1} << 60); },
                                       {"kernel scratch", "out of memory", "refused"});
  // Scratch memory sits on 64-byte boundaries (the kernels' summation order depends on it).
  scratch.resize(3);
  CHECK(reinterpret_cast<std::uintptr_t>(scratch.data()) % 64 == 0);
  kernels::Scratch<std::uint8_t> bytes(1);
  CHECK(reinterpret_cast<std::uintptr_t>(bytes.data()) % 64 == 0);
}
