// Fused attention on Eigen: the shared kernel (attention_kernel.h) with Eigen's products on the
// blocks. f32 and f64 multiply in place through the views' strides; bf16 and f16 blocks are
// widened to f32 as they are read (the statistics are f32 in every case).
#include "attention_kernel.h"
#include "eigen_backend.h"

namespace ruda {

using namespace kernels;

namespace {
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
}

void EigenBackend::attention(const AttentionDesc& d) {
  dispatch_float(d.q.dtype, "scaled_dot_product_attention", [&](auto tag) {
    using T = decltype(tag);
    attention::forward<T, Acc<T>, Acc<T>>(d, [] { return attention::EigenBlockGemm<Acc<T>>{}; });
  });
}

void EigenBackend::attention_backward(const AttentionDesc& d) {
  dispatch_float(d.q.dtype, "scaled_dot_product_attention backward", [&](auto tag) {
    using T = decltype(tag);
    attention::backward<T, Acc<T>, Acc<T>>(d, [] { return attention::EigenBlockGemm<Acc<T>>{}; });
  });
}

}  // namespace ruda
