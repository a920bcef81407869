// Unary math and activations on oneDNN's eltwise primitives, forward and backward. The tensors
// are contiguous, so each is one 1-D buffer of n values: the primitive depends on the op, the
// dtype and n only.
#include <optional>
#include <string>

#include "context.h"
#include "kernel_policy.h"
#include "onednn_backend.h"

namespace ruda::onednn {

using namespace detail;
using dnnl::algorithm;
using dnnl::memory;

namespace {

struct Eltwise {
  algorithm alg;
  float alpha = 0.0f, beta = 0.0f;
  bool from_output = false;  // backward reads y (the *_use_dst_for_bwd algorithms) instead of x
};

std::optional<Eltwise> forward_of(UnaryOp op) {
  switch (op) {
    case UnaryOp::neg:
      return Eltwise{algorithm::eltwise_linear, -1.0f, 0.0f};
    case UnaryOp::abs:
      return Eltwise{algorithm::eltwise_abs};
    case UnaryOp::exp:
      return Eltwise{algorithm::eltwise_exp};
    case UnaryOp::log:
      return Eltwise{algorithm::eltwise_log};
    case UnaryOp::sqrt:
      return Eltwise{algorithm::eltwise_sqrt};
    case UnaryOp::rsqrt:
      return Eltwise{algorithm::eltwise_pow, 1.0f, -0.5f};
    case UnaryOp::tanh:
      return Eltwise{algorithm::eltwise_tanh};
    case UnaryOp::sigmoid:
      return Eltwise{algorithm::eltwise_logistic};
    case UnaryOp::relu:
      return Eltwise{algorithm::eltwise_relu};
    case UnaryOp::gelu_tanh:
      return Eltwise{algorithm::eltwise_gelu_tanh};
    case UnaryOp::gelu_erf:
      return Eltwise{algorithm::eltwise_gelu_erf};
    case UnaryOp::silu:
      return Eltwise{algorithm::eltwise_swish, 1.0f};
    case UnaryOp::softplus:
      return Eltwise{algorithm::eltwise_soft_relu};
    case UnaryOp::square:
      return Eltwise{algorithm::eltwise_square};
    case UnaryOp::reciprocal:
      return Eltwise{algorithm::eltwise_pow, 1.0f, -1.0f};
  }
  return std::nullopt;
}

// The engine saves what each derivative reads: x for the ones below that take it, y for the
// ones with a *_use_dst_for_bwd algorithm. rsqrt and reciprocal save only y, and oneDNN's pow
// backward needs x, so they have none.
std::optional<Eltwise> backward_of(UnaryOp op) {
  switch (op) {
    case UnaryOp::abs:
    case UnaryOp::log:
    case UnaryOp::gelu_tanh:
    case UnaryOp::gelu_erf:
    case UnaryOp::silu:
    case UnaryOp::softplus:
    case UnaryOp::square:
      return forward_of(op);
    case UnaryOp::exp:
      return Eltwise{algorithm::eltwise_exp_use_dst_for_bwd, 0.0f, 0.0f, true};
    case UnaryOp::sqrt:
      return Eltwise{algorithm::eltwise_sqrt_use_dst_for_bwd, 0.0f, 0.0f, true};
    case UnaryOp::tanh:
      return Eltwise{algorithm::eltwise_tanh_use_dst_for_bwd, 0.0f, 0.0f, true};
    case UnaryOp::sigmoid:
      return Eltwise{algorithm::eltwise_logistic_use_dst_for_bwd, 0.0f, 0.0f, true};
    case UnaryOp::relu:
      return Eltwise{algorithm::eltwise_relu_use_dst_for_bwd, 0.0f, 0.0f, true};
    case UnaryOp::neg:
    case UnaryOp::rsqrt:
    case UnaryOp::reciprocal:
      return std::nullopt;
  }
  return std::nullopt;
}

memory::desc flat(std::int64_t n, memory::data_type type) { return memory::desc({n}, type, memory::dims{1}); }

}  // namespace

// oneDNN 2.6's relu (a max with zero in its JIT kernels) turns NaN into 0, and its backward drops
// the gradient there: a NaN that should stop training would vanish. Eigen's relu propagates it.
constexpr std::string_view kReluNanReason = "oneDNN's relu maps NaN to 0";

void OneDnnBackend::unary(UnaryOp op, const View& x, const View& y) {
  const auto type = dnnl_type(x.dtype);
  if (!type) {
    note_fallback(op_name(op), x.dtype, "oneDNN 2.6 has no eltwise for this dtype");
    return EigenBackend::unary(op, x, y);
  }
  if (x.numel() < kMinElements) {
    note_fallback(op_name(op), x.dtype, kSmallReason);
    return EigenBackend::unary(op, x, y);
  }
  if (op == UnaryOp::softplus) {
    // oneDNN 2.6's soft_relu computes log(1 + exp(x)) directly: for x below about -15 its result
    // is off by ~2e-6 in absolute terms, negative where softplus is tiny and positive.
    note_fallback(op_name(op), x.dtype, "oneDNN's soft_relu is inaccurate (even negative) for negative inputs");
    return EigenBackend::unary(op, x, y);
  }
  if (op == UnaryOp::relu) {
    note_fallback(op_name(op), x.dtype, kReluNanReason);
    return EigenBackend::unary(op, x, y);
  }
  if (eigen_faster_unary(op, false, x.dtype)) {
    note_fallback(op_name(op), x.dtype, kEigenFasterReason);
    return EigenBackend::unary(op, x, y);
  }
  const Eltwise e = *forward_of(op);
  const std::int64_t n = x.numel();
  Key key;
  key << std::int64_t{2} << static_cast<std::int64_t>(e.alg) << e.alpha << e.beta << static_cast<std::int64_t>(x.dtype)
      << n;
  const auto p = lookup(key, threads_for(n), [&] {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::eltwise_forward::desc desc(dnnl::prop_kind::forward_training, e.alg, flat(n, *type), e.alpha, e.beta);
    return make_primitive(dnnl::eltwise_forward::primitive_desc(desc, attr, cpu_engine()),
                          {DNNL_ARG_SRC, DNNL_ARG_DST});
  });
  if (p->refused()) {
    note_fallback(op_name(op), x.dtype, p->refusal);
    return EigenBackend::unary(op, x, y);
  }
  execute(p, {{DNNL_ARG_SRC, x.data}, {DNNL_ARG_DST, y.data}});
}

void OneDnnBackend::unary_backward(UnaryOp op, const View& x, const View& y, const View& gy, const View& gx) {
  auto on_eigen = [&](std::string_view reason) {
    note_fallback(std::string(op_name(op)) + " backward", gy.dtype, reason);
    EigenBackend::unary_backward(op, x, y, gy, gx);
  };
  const auto type = dnnl_type(gy.dtype);
  if (!type) {
    return on_eigen("oneDNN 2.6 has no eltwise backward for this dtype");
  }
  if (gy.numel() < kMinElements) {
    return on_eigen(kSmallReason);
  }
  if (op == UnaryOp::relu) {
    return on_eigen(kReluNanReason);
  }
  if (eigen_faster_unary(op, true, gy.dtype)) {
    return on_eigen(kEigenFasterReason);
  }
  const auto e = backward_of(op);
  if (!e || !(e->from_output ? y.data : x.data)) {
    return on_eigen("no oneDNN eltwise backward from the saved tensor");
  }
  const std::int64_t n = gy.numel();
  Key key;
  key << std::int64_t{3} << static_cast<std::int64_t>(e->alg) << e->alpha << e->beta
      << static_cast<std::int64_t>(gy.dtype) << n;
  const int data_arg = e->from_output ? DNNL_ARG_DST : DNNL_ARG_SRC;
  const auto p = lookup(key, threads_for(n), [&] {
    const memory::desc md = flat(n, *type);
    const dnnl::eltwise_forward::primitive_desc hint(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, e->alg, md, e->alpha, e->beta), cpu_engine());
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::eltwise_backward::desc desc(e->alg, md, md, e->alpha, e->beta);
    return make_primitive(dnnl::eltwise_backward::primitive_desc(desc, attr, cpu_engine(), hint),
                          {data_arg, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC});
  });
  if (p->refused()) {
    return on_eigen(p->refusal);
  }
  execute(p,
          {{data_arg, e->from_output ? y.data : x.data}, {DNNL_ARG_DIFF_DST, gy.data}, {DNNL_ARG_DIFF_SRC, gx.data}});
}

}  // namespace ruda::onednn
