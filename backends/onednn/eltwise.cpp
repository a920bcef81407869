// Unary math and activations on oneDNN's eltwise primitives, forward and backward. The tensors
// are contiguous, so each is one 1-D buffer of n values: the primitive depends on the op, the
// dtype and n only.
#include <optional>
#include <string>

#include "context.h"
#include "kernel_policy.h"
#include "onednn_backend.h"
#include "op_descriptors.h"

namespace ruda::onednn {

using namespace detail;
using dnnl::algorithm;
using dnnl::memory;

namespace {

// The descriptors' names for oneDNN's algorithms (engine/src/op_descriptors.h); none where
// oneDNN has no such kernel.
std::optional<algorithm> to_dnnl(ops::DnnlAlg alg) {
  switch (alg) {
    case ops::DnnlAlg::none:
      return std::nullopt;
    case ops::DnnlAlg::linear:
      return algorithm::eltwise_linear;
    case ops::DnnlAlg::abs:
      return algorithm::eltwise_abs;
    case ops::DnnlAlg::exp:
      return algorithm::eltwise_exp;
    case ops::DnnlAlg::log:
      return algorithm::eltwise_log;
    case ops::DnnlAlg::sqrt:
      return algorithm::eltwise_sqrt;
    case ops::DnnlAlg::pow:
      return algorithm::eltwise_pow;
    case ops::DnnlAlg::tanh:
      return algorithm::eltwise_tanh;
    case ops::DnnlAlg::logistic:
      return algorithm::eltwise_logistic;
    case ops::DnnlAlg::relu:
      return algorithm::eltwise_relu;
    case ops::DnnlAlg::gelu_tanh:
      return algorithm::eltwise_gelu_tanh;
    case ops::DnnlAlg::gelu_erf:
      return algorithm::eltwise_gelu_erf;
    case ops::DnnlAlg::swish:
      return algorithm::eltwise_swish;
    case ops::DnnlAlg::soft_relu:
      return algorithm::eltwise_soft_relu;
    case ops::DnnlAlg::square:
      return algorithm::eltwise_square;
    case ops::DnnlAlg::exp_use_dst_for_bwd:
      return algorithm::eltwise_exp_use_dst_for_bwd;
    case ops::DnnlAlg::sqrt_use_dst_for_bwd:
      return algorithm::eltwise_sqrt_use_dst_for_bwd;
    case ops::DnnlAlg::tanh_use_dst_for_bwd:
      return algorithm::eltwise_tanh_use_dst_for_bwd;
    case ops::DnnlAlg::logistic_use_dst_for_bwd:
      return algorithm::eltwise_logistic_use_dst_for_bwd;
    case ops::DnnlAlg::relu_use_dst_for_bwd:
      return algorithm::eltwise_relu_use_dst_for_bwd;
  }
  return std::nullopt;
}

memory::desc flat(std::int64_t n, memory::data_type type) { return memory::desc({n}, type, memory::dims{1}); }

}  // namespace

namespace {

// Why unary() runs Eigen's kernel for this op and x, or nothing where it asks oneDNN (which may
// still refuse the primitive, and then runs Eigen's too).
std::optional<std::string_view> eigen_forward_reason(const ops::UnaryInfo& info, const View& x) {
  if (!to_dnnl(info.onednn.forward.alg)) return "oneDNN 2.6 has no eltwise algorithm for this op";
  if (!dnnl_type(x.dtype)) return "oneDNN 2.6 has no eltwise for this dtype";
  if (x.numel() < kMinElements) return kSmallReason;
  if (!info.onednn.avoid_forward.empty()) return info.onednn.avoid_forward;
  if (eigen_faster_unary(info.onednn.forward_slower, x.dtype)) return kEigenFasterReason;
  return std::nullopt;
}

}  // namespace

// Every op runs on oneDNN where its descriptor names an algorithm, the dtype has a oneDNN type,
// the tensor is large enough and no measurement or caveat says otherwise; each other case runs
// Eigen's kernel, recorded once as a fallback with its reason.
void OneDnnBackend::unary(UnaryOp op, const View& x, const View& y) {
  const ops::UnaryInfo info = ops::unary_info(op);
  const ops::DnnlEltwise& e = info.onednn.forward;
  auto on_eigen = [&](std::string_view reason) {
    note_fallback(info.name, x.dtype, reason);
    EigenBackend::unary(op, x, y);
  };
  if (const auto reason = eigen_forward_reason(info, x)) return on_eigen(*reason);
  const std::optional<algorithm> alg = to_dnnl(e.alg);
  const auto type = dnnl_type(x.dtype);
  const std::int64_t n = x.numel();
  Key key;
  key << std::int64_t{2} << static_cast<std::int64_t>(*alg) << e.alpha << e.beta << static_cast<std::int64_t>(x.dtype)
      << n;
  const auto p = lookup(key, threads_for(n), [&] {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::eltwise_forward::desc desc(dnnl::prop_kind::forward_training, *alg, flat(n, *type), e.alpha, e.beta);
    return make_primitive(dnnl::eltwise_forward::primitive_desc(desc, attr, cpu_engine()),
                          {DNNL_ARG_SRC, DNNL_ARG_DST});
  });
  if (p->refused()) return on_eigen(p->refusal);
  execute(p, {{DNNL_ARG_SRC, x.data}, {DNNL_ARG_DST, y.data}});
}

void OneDnnBackend::unary_backward(UnaryOp op, const View& x, const View& y, const View& gy, const View& gx) {
  const ops::UnaryInfo info = ops::unary_info(op);
  const ops::DnnlEltwise& e = info.onednn.backward;
  auto on_eigen = [&](std::string_view reason) {
    note_fallback(std::string(info.name) + " backward", gy.dtype, reason);
    EigenBackend::unary_backward(op, x, y, gy, gx);
  };
  const std::optional<algorithm> alg = to_dnnl(e.alg);
  if (!alg) return on_eigen("no oneDNN eltwise backward for this op from what it saves");
  const auto type = dnnl_type(gy.dtype);
  if (!type) return on_eigen("oneDNN 2.6 has no eltwise backward for this dtype");
  if (gy.numel() < kMinElements) return on_eigen(kSmallReason);
  if (!info.onednn.avoid_backward.empty()) return on_eigen(info.onednn.avoid_backward);
  if (eigen_faster_unary(info.onednn.backward_slower, gy.dtype)) return on_eigen(kEigenFasterReason);
  const bool from_output = ops::reads_output(e.alg);  // a *_use_dst_for_bwd algorithm reads y
  const View& data = from_output ? y : x;
  if (!data.data) return on_eigen("no oneDNN eltwise backward from the saved tensor");
  const std::int64_t n = gy.numel();
  Key key;
  key << std::int64_t{3} << static_cast<std::int64_t>(*alg) << e.alpha << e.beta << static_cast<std::int64_t>(gy.dtype)
      << n;
  const int data_arg = from_output ? DNNL_ARG_DST : DNNL_ARG_SRC;
  const auto p = lookup(key, threads_for(n), [&] {
    const memory::desc md = flat(n, *type);
    const dnnl::eltwise_forward::primitive_desc hint(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, *alg, md, e.alpha, e.beta), cpu_engine());
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::eltwise_backward::desc desc(*alg, md, md, e.alpha, e.beta);
    return make_primitive(dnnl::eltwise_backward::primitive_desc(desc, attr, cpu_engine(), hint),
                          {data_arg, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC});
  });
  if (p->refused()) return on_eigen(p->refusal);
  execute(p, {{data_arg, data.data}, {DNNL_ARG_DIFF_DST, gy.data}, {DNNL_ARG_DIFF_SRC, gx.data}});
}

// y from the kernel unary() runs for the same op and x, so that linear_gelu's forward gives the
// same bits with grad (this call) and without (unary; a checkpointed block's first pass): where
// unary() runs Eigen's kernel, Eigen's one pass for both (the same formula); where it asks
// oneDNN (bf16 ops oneDNN is faster at; every op under RUDA_ONEDNN_KERNELS=all), unary() and then
// the derivative as unary_backward with gy = 1, the base class's default.
// (Both targets check the Views first.)
void OneDnnBackend::unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx) {
  const ops::UnaryInfo info = ops::unary_info(op);
  if (const auto reason = eigen_forward_reason(info, x)) {
    note_fallback(std::string(info.name) + " with derivative", x.dtype, *reason);
    return EigenBackend::unary_with_derivative(op, x, y, dydx);
  }
  Backend::unary_with_derivative(op, x, y, dydx);
}

}  // namespace ruda::onednn
