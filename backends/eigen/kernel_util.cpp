#include "kernel_util.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include <ruda/memory.h>

namespace ruda::kernels {

void scratch_refused(std::size_t bytes) {
  // (A count past int64 is the size of a count that overflowed: said as the most it can name.)
  const auto shown = static_cast<std::int64_t>(std::min<std::size_t>(bytes, std::numeric_limits<std::int64_t>::max()));
  fail<OutOfMemoryError>("kernel scratch", "out of memory: the system refused ", memory::format_bytes(shown),
                         " of a kernel's working memory");
}

OutOfMemoryError library_memory_refused(const char* op) {
  // (Said of any kernel: parallel_for converts every std::bad_alloc, Eigen's the one known.)
  return OutOfMemoryError(std::string(op) +
                          ": out of memory: the system refused memory a library allocates itself inside a kernel "
                          "(a std::bad_alloc, such as Eigen's GEMM packing buffers): under an address-space limit "
                          "(ulimit -v) leave more room, or train smaller");
}

}  // namespace ruda::kernels
