// The backends' kernel helpers (backends/eigen/kernel_util.h) that callers never see directly:
// parallel_for hands an exception from any chunk to its caller (an exception leaving an OpenMP
// region ends the process in std::terminate), and kernel scratch memory the system refuses is an
// OutOfMemoryError, not a std::bad_alloc that no `catch (const ruda::Error&)` sees.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "eigen/kernel_util.h"
#include "helpers.h"
#include "sanitized.h"

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
  // Every chunk throwing: one exception arrives, of its own type; a std::bad_alloc (a library's
  // own allocation inside a kernel, Eigen's GEMM buffers) as an OutOfMemoryError, in parallel and
  // inline, which callers that catch ruda::Error (auto-fit) see.
  CHECK_THROWS_AS(kernels::parallel_for(total, 1, [](std::int64_t, std::int64_t) { throw IndexError("x"); }),
                  IndexError);
  test::check_throws<OutOfMemoryError>(
      [&] { kernels::parallel_for(total, 1, [](std::int64_t, std::int64_t) { throw std::bad_alloc(); }); },
      {"out of memory", "std::bad_alloc"});
  test::check_throws<OutOfMemoryError>(
      [&] { kernels::parallel_for(10, 1 << 20, [](std::int64_t, std::int64_t) { throw std::bad_alloc(); }); },
      {"out of memory", "std::bad_alloc"});
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

TEST_CASE("a matrix product whose library buffers the system refuses is an OutOfMemoryError on every backend") {
#ifdef RUDA_TEST_SANITIZED
  // The sanitizers map terabytes of shadow memory: no address-space limit leaves them room to run.
  MESSAGE("not run under a sanitizer (an address-space limit stops the sanitizer itself)");
#else
  // Under an address-space limit (ulimit -v, a batch system's h_vmem) Eigen's GEMM threw
  // std::bad_alloc inside its own OpenMP region (std::terminate: SIGABRT) or out of it (no
  // ruda::Error), and oneDNN 2.6 crashed (SIGSEGV) generating a primitive's code. The product
  // runs in a child process (address_limit_child.cpp; libgomp does not survive a fork), whose exit
  // code says what it raised: 0 an OutOfMemoryError.
  for (const std::string& name : available_backends()) {
    CAPTURE(name);
    const std::string child = RUDA_ADDRESS_LIMIT_CHILD;
    char* const argv[] = {const_cast<char*>(child.c_str()), const_cast<char*>(name.c_str()), nullptr};
    pid_t pid = 0;
    REQUIRE(::posix_spawn(&pid, child.c_str(), nullptr, nullptr, argv, environ) == 0);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK_MESSAGE(WIFEXITED(status), "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
    if (WIFEXITED(status)) CHECK(WEXITSTATUS(status) == 0);
  }
#endif
}
