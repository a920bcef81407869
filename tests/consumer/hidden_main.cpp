// A consumer built with -fvisibility=hidden, as Python extension modules (pybind11) are: ruda's
// thread-scoped flags must be the library's own, not copies of the program's. With the flag
// defined inline in a public header, this program's DeferredInit deferred nothing and its
// LimitSuspended suspended nothing (each scope raised a hidden copy the library never read).
#include <cstdio>

#include <ruda/nn.h>
#include <ruda/ruda.h>

int main() {
  using namespace ruda;
  {
    nn::DeferredInit deferred;
    nn::Linear layer(4, 3);
    if (!layer.parameters()[0].is_deferred()) {
      std::fprintf(stderr, "DeferredInit deferred nothing in a -fvisibility=hidden program\n");
      return 1;
    }
  }
  memory::set_limit(1024);
  try {
    memory::LimitSuspended suspended;
    const Tensor big = zeros({1024, 64});
  } catch (const OutOfMemoryError& e) {
    std::fprintf(stderr, "LimitSuspended suspended nothing in a -fvisibility=hidden program: %s\n", e.what());
    return 1;
  }
  memory::set_limit(0);
  std::puts("thread-scoped flags shared with the library under -fvisibility=hidden");
  return 0;
}
