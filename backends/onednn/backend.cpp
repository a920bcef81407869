// Registration of the oneDNN backend, and the kernels it always leaves to Eigen.
#include <memory>

#include <ruda/error.h>

#include "context.h"
#include "onednn.h"
#include "onednn_backend.h"

namespace ruda::onednn {

using detail::note_fallback;

std::unique_ptr<Backend> make_backend() {
  // Build the engine now: a oneDNN that cannot start (no usable CPU runtime) fails the backend
  // lookup with an error that names it, rather than a later kernel call.
  try {
    detail::cpu_engine();
  } catch (const dnnl::error& e) {
    fail<BackendError>("onednn", "could not create a oneDNN CPU engine: ", e.what());
  }
  return std::make_unique<OneDnnBackend>();
}

void OneDnnBackend::fill(const View& out, double value) {
  note_fallback("fill", out.dtype, "a plain memory fill: oneDNN has no primitive for it");
  EigenBackend::fill(out, value);
}

void OneDnnBackend::copy(const View& src, const View& dst) {
  note_fallback("copy", dst.dtype, "strided copies (permute, slice, expand) are not routed through oneDNN reorders");
  EigenBackend::copy(src, dst);
}

void OneDnnBackend::cast(const View& src, const View& dst) {
  // Measured on oneDNN 2.6.3: its f32->bf16 reorder flushes subnormals to zero (ruda rounds them
  // to nearest even) and is no faster than the Eigen backend's vectorized loop; its f16 reorders
  // are scalar "simple:any" kernels, two orders of magnitude slower.
  note_fallback("cast", src.dtype, "oneDNN reorders flush bf16 subnormals and are no faster than ruda's exact loop");
  EigenBackend::cast(src, dst);
}

void OneDnnBackend::where(const View& cond, const View& a, const View& b, const View& out) {
  note_fallback("where", out.dtype, "oneDNN 2.6 has no select primitive");
  EigenBackend::where(cond, a, b, out);
}

void OneDnnBackend::gather_rows(const View& table, const View& index, const View& out) {
  note_fallback("gather_rows", table.dtype, "oneDNN 2.6 has no gather primitive");
  EigenBackend::gather_rows(table, index, out);
}

void OneDnnBackend::scatter_add_rows(const View& src, const View& index, const View& table) {
  note_fallback("scatter_add_rows", table.dtype, "oneDNN 2.6 has no scatter primitive");
  EigenBackend::scatter_add_rows(src, index, table);
}

void OneDnnBackend::take_along_rows(const View& x, const View& index, const View& out) {
  note_fallback("take_along_rows", x.dtype, "oneDNN 2.6 has no gather primitive");
  EigenBackend::take_along_rows(x, index, out);
}

void OneDnnBackend::put_add_along_rows(const View& src, const View& index, const View& x) {
  note_fallback("put_add_along_rows", x.dtype, "oneDNN 2.6 has no scatter primitive");
  EigenBackend::put_add_along_rows(src, index, x);
}

void OneDnnBackend::adam_update(const AdamDesc& desc) {
  note_fallback("adam_update", desc.param.dtype, "a fused optimizer step: oneDNN has no primitive for it");
  EigenBackend::adam_update(desc);
}

}  // namespace ruda::onednn
