#include "kernel_util.h"

#include <ruda/memory.h>

namespace ruda::kernels {

void scratch_refused(std::size_t bytes) {
  fail<OutOfMemoryError>("kernel scratch", "out of memory: the system refused ", memory::format_bytes(bytes),
                         " of a kernel's working memory");
}

}  // namespace ruda::kernels
