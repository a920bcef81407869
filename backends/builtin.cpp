// The backends this build contains, registered once when the engine first looks one up.
#include <memory>

#include "eigen/eigen_backend.h"

#ifdef RUDA_HAVE_ONEDNN
namespace ruda::onednn {
std::unique_ptr<Backend> make_backend();
}
#endif

namespace ruda::detail {

void register_builtin_backends() {
  register_backend("eigen", [] { return std::make_unique<EigenBackend>(); });
#ifdef RUDA_HAVE_ONEDNN
  register_backend("onednn", [] { return onednn::make_backend(); });
#endif
}

}  // namespace ruda::detail
