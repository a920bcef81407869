// A matrix product under an address-space limit, for test_engine_kernel_util (a child process:
// libgomp's threads do not survive a fork). Usage: address_limit_child BACKEND. Exit codes: 0 an
// OutOfMemoryError, 1 a std::bad_alloc, 2 another exception, 3 no error, 4 the setup failed,
// 5 setrlimit failed; a signal (SIGABRT from std::terminate, SIGSEGV) is the old defect.
#include <sys/resource.h>

#include <cstdint>
#include <fstream>
#include <new>
#include <string>

#include <ruda/ruda.h>

using namespace ruda;

namespace {
// The process's mapped bytes (VmSize), from /proc/self/status.
std::uint64_t mapped_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  return 0;
}

GemmDesc square_product(const Tensor& a, const Tensor& b, Tensor& c) {
  GemmDesc d;
  d.a = a.data_ptr();
  d.b = b.data_ptr();
  d.c = c.data_ptr();
  d.m = d.n = d.k = a.size(0);
  return d;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 4;
  Tensor a, b, c;
  Backend* backend = nullptr;
  try {
    set_num_threads(2);
    backend = &get_backend(argv[1]);
    // A first product starts the OpenMP threads (their stacks) before the limit.
    Tensor x = randn({96, 96}, 1), y = randn({96, 96}, 2), z = zeros({96, 96});
    GemmDesc warm = square_product(x, y, z);
    backend->gemm(warm);
    a = randn({1536, 1536}, 3);
    b = randn({1536, 1536}, 4);
    c = zeros({1536, 1536});
  } catch (...) {
    return 4;
  }
  // A few KB more than is mapped now: a shape no earlier product had (a fresh oneDNN primitive,
  // Eigen's packing buffers) cannot get its memory.
  const rlimit limit{mapped_bytes() + (std::uint64_t{64} << 10), RLIM_INFINITY};
  if (::setrlimit(RLIMIT_AS, &limit) != 0) return 5;
  try {
    GemmDesc d = square_product(a, b, c);
    backend->gemm(d);
    return 3;
  } catch (const OutOfMemoryError& e) {
    return std::string(e.what()).find("out of memory") != std::string::npos ? 0 : 2;
  } catch (const std::bad_alloc&) {
    return 1;
  } catch (...) {
    return 2;
  }
}
