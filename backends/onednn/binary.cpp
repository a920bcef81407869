// Binary arithmetic and comparisons on oneDNN's binary primitive, broadcasting through the
// views' strides. oneDNN broadcasts only its second source, so a broadcast left operand swaps
// sides (with the mirrored comparison, or sub as an add of the negated other operand). Comparisons write u8 0/1,
// ruda's bool; gt and ge always run as lt and le with swapped sides (see below).
#include <algorithm>
#include <optional>

#include "context.h"
#include "kernel_policy.h"
#include "onednn_backend.h"

namespace ruda::onednn {

using namespace detail;
using dnnl::algorithm;
using dnnl::memory;

namespace {

// The three operands over one logical shape, with extent-1 axes dropped and neighbouring axes
// merged wherever every operand is laid out densely across them and broadcasts the same way
// (fewer, larger dimensions: more cache hits and the fastest oneDNN kernels).
struct Canonical {
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[3][kMaxDims] = {};  // a, b, out; 0 on broadcast axes
};

Canonical canonical(const View& a, const View& b, const View& out) {
  const View* views[3] = {&a, &b, &out};
  Canonical c;
  for (int d = 0; d < out.ndim; ++d) {
    if (out.shape[d] == 1) continue;
    bool merge = c.ndim > 0;
    for (int k = 0; k < 3 && merge; ++k) {
      const std::int64_t inner = views[k]->strides[d], outer = c.strides[k][c.ndim - 1];
      merge = (inner == 0) == (outer == 0) && (inner == 0 || outer == inner * out.shape[d]);
    }
    if (merge) {
      c.shape[c.ndim - 1] *= out.shape[d];
      for (int k = 0; k < 3; ++k) c.strides[k][c.ndim - 1] = views[k]->strides[d];
    } else {
      c.shape[c.ndim] = out.shape[d];
      for (int k = 0; k < 3; ++k) c.strides[k][c.ndim] = views[k]->strides[d];
      ++c.ndim;
    }
  }
  if (c.ndim == 0) {  // one element
    c.ndim = 1;
    c.shape[0] = 1;
    for (auto& s : c.strides) s[0] = 1;
  }
  if (c.ndim == 1) {
    // oneDNN 2.6 runs 1-D comparisons (u8 output) and 1-D broadcasts on its reference kernel
    // only; as [1, n] they get the jit one.
    c.shape[1] = c.shape[0];
    c.shape[0] = 1;
    for (auto& s : c.strides) {
      s[1] = s[0];
      s[0] = s[1] * c.shape[1];  // stays 0 for a broadcast operand
    }
    c.ndim = 2;
  }
  return c;
}

bool broadcasts(const Canonical& c, int k) {
  for (int d = 0; d < c.ndim; ++d) {
    if (c.strides[k][d] == 0) return true;
  }
  return false;
}

std::optional<algorithm> algorithm_of(BinaryOp op) {
  switch (op) {
    case BinaryOp::add:
      return algorithm::binary_add;
    case BinaryOp::sub:
      return algorithm::binary_sub;
    case BinaryOp::mul:
      return algorithm::binary_mul;
    case BinaryOp::div:
      return algorithm::binary_div;
    case BinaryOp::eq:
      return algorithm::binary_eq;
    case BinaryOp::ne:
      return algorithm::binary_ne;
    case BinaryOp::lt:
      return algorithm::binary_lt;
    case BinaryOp::le:
      return algorithm::binary_le;
    // oneDNN 2.6's gt/ge are "not less-or-equal" / "not less": true when an operand is NaN
    // (measured), where ruda's comparisons are false. binary() runs them as lt/le, swapped.
    case BinaryOp::gt:
      return algorithm::binary_gt;
    case BinaryOp::ge:
      return algorithm::binary_ge;
    // maximum/minimum: oneDNN's max/min keep one operand when the other is NaN (x86 max/min
    // semantics); ruda propagates NaN. pow: oneDNN 2.6 has no binary pow.
    case BinaryOp::maximum:
    case BinaryOp::minimum:
    case BinaryOp::pow:
      return std::nullopt;
  }
  return std::nullopt;
}

// b (op) a for a (op) b, when the operands swap sides; none where no algorithm says it.
std::optional<algorithm> mirrored(BinaryOp op, bool& negate_src0) {
  negate_src0 = false;
  switch (op) {
    case BinaryOp::add:
      return algorithm::binary_add;
    case BinaryOp::mul:
      return algorithm::binary_mul;
    case BinaryOp::eq:
      return algorithm::binary_eq;
    case BinaryOp::ne:
      return algorithm::binary_ne;
    case BinaryOp::lt:
      return algorithm::binary_gt;
    case BinaryOp::le:
      return algorithm::binary_ge;
    case BinaryOp::gt:
      return algorithm::binary_lt;
    case BinaryOp::ge:
      return algorithm::binary_le;
    // a - b as (-b) + a, with -b oneDNN's scale of -1 on its first source: IEEE's a - b is a + (-b),
    // so every bit agrees, zeros' signs included (as -(b - a), with a negating post-op, +0 - +0
    // came out -0, or -0 - 0 +0 with a post-op of -x + 0; on the Eigen kernel instead, a bf16
    // 1 - x took 3x the time).
    case BinaryOp::sub:
      negate_src0 = true;
      return algorithm::binary_add;
    case BinaryOp::div:
    case BinaryOp::pow:
    case BinaryOp::maximum:
    case BinaryOp::minimum:
      return std::nullopt;
  }
  return std::nullopt;
}

// A descriptor with the canonical dims (1 where the operand broadcasts). Broadcast axes get the
// strides a dense layout would have, so a broadcast operand such as a bias row reads as dense.
memory::desc operand_desc(const Canonical& c, int k, memory::data_type type) {
  memory::dims dims(c.ndim), strides(c.ndim);
  std::int64_t dense = 1;
  for (int d = c.ndim - 1; d >= 0; --d) {
    const bool broadcast = c.strides[k][d] == 0;
    dims[d] = broadcast ? 1 : c.shape[d];
    strides[d] = broadcast ? dense : c.strides[k][d];
    dense = strides[d] * dims[d];
  }
  return memory::desc(dims, type, strides);
}

}  // namespace

void OneDnnBackend::binary(BinaryOp op, const View& a, const View& b, const View& out) {
  const auto in_type = dnnl_type(a.dtype);
  const auto out_type = out.dtype == DType::boolean ? std::optional(memory::data_type::u8) : dnnl_type(out.dtype);
  if (!in_type || !out_type) {
    note_fallback(op_name(op), a.dtype, "oneDNN 2.6 has no binary primitive for this dtype");
    return EigenBackend::binary(op, a, b, out);
  }
  if (out.numel() < kMinElements) {
    note_fallback(op_name(op), a.dtype, kSmallReason);
    return EigenBackend::binary(op, a, b, out);
  }
  if (!algorithm_of(op)) {
    note_fallback(op_name(op), a.dtype,
                  op == BinaryOp::pow ? "oneDNN 2.6 has no binary pow" : "oneDNN's max/min do not propagate NaN");
    return EigenBackend::binary(op, a, b, out);
  }
  const Canonical c = canonical(a, b, out);
  const bool a_broadcasts = broadcasts(c, 0), b_broadcasts = broadcasts(c, 1);
  if (a_broadcasts && b_broadcasts) {
    note_fallback(op_name(op), a.dtype, "both operands broadcast: oneDNN broadcasts only its second source");
    return EigenBackend::binary(op, a, b, out);
  }
  if ((a_broadcasts || b_broadcasts) && eigen_faster_broadcast_binary(a.dtype)) {
    note_fallback(op_name(op), a.dtype, kEigenFasterReason);
    return EigenBackend::binary(op, a, b, out);
  }
  // oneDNN broadcasts only its second source, so a broadcast a swaps sides; so do gt and ge on
  // equal shapes, to run as lt and le: oneDNN's gt/ge are true when an operand is NaN.
  const bool swap = a_broadcasts || (!b_broadcasts && (op == BinaryOp::gt || op == BinaryOp::ge));
  bool negate_src0 = false;
  const auto alg = swap ? mirrored(op, negate_src0) : algorithm_of(op);
  if (!alg) {
    note_fallback(op_name(op), a.dtype, "its left operand broadcasts and the op has no mirrored oneDNN form");
    return EigenBackend::binary(op, a, b, out);
  }
  if (*alg == algorithm::binary_gt || *alg == algorithm::binary_ge) {
    note_fallback(op_name(op), a.dtype,
                  swap
                      ? "its left operand broadcasts, and the mirrored oneDNN gt/ge are true for NaN operands"
                      : "its right operand broadcasts, so it cannot run as lt/le, and oneDNN's gt/ge are true for NaN");
    return EigenBackend::binary(op, a, b, out);
  }
  const int src0 = swap ? 1 : 0, src1 = swap ? 0 : 1;
  if (out.dtype == DType::boolean && !std::equal(c.strides[src0], c.strides[src0] + c.ndim, c.strides[2])) {
    // oneDNN 2.6's jit binary writes a comparison (u8 output) of two operands laid out alike in
    // their layout rather than the output's: lt of two transposed [131, 203] f32 matrices had
    // half its values wrong, as had every comparison of two alike-permuted [6, 50, 40] operands.
    // Arithmetic (output of the operands' type) measured right in every layout, and comparisons
    // whose first source is laid out as the output did; the rest go to the Eigen kernel.
    note_fallback(op_name(op), a.dtype,
                  "a comparison whose first operand is not laid out as its output (oneDNN 2.6 writes some such "
                  "in the operands' layout)");
    return EigenBackend::binary(op, a, b, out);
  }

  Key key;
  key << std::int64_t{4} << static_cast<std::int64_t>(*alg) << std::int64_t{negate_src0}
      << static_cast<std::int64_t>(a.dtype) << static_cast<std::int64_t>(out.dtype) << std::int64_t{c.ndim};
  for (int d = 0; d < c.ndim; ++d) key << c.shape[d] << c.strides[src0][d] << c.strides[src1][d] << c.strides[2][d];
  const auto p = lookup(key, threads_for(out.numel()), [&] {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (negate_src0) attr.set_scales(DNNL_ARG_SRC_0, 0, {-1.0f});
    const dnnl::binary::desc desc(*alg, operand_desc(c, src0, *in_type), operand_desc(c, src1, *in_type),
                                  operand_desc(c, 2, *out_type));
    return make_primitive(dnnl::binary::primitive_desc(desc, attr, cpu_engine()),
                          {DNNL_ARG_SRC_0, DNNL_ARG_SRC_1, DNNL_ARG_DST});
  });
  if (p->refused()) {
    note_fallback(op_name(op), a.dtype,
                  p->refusal + " for " + dims_string(operand_desc(c, src0, *in_type).dims()) + " with " +
                      dims_string(operand_desc(c, src1, *in_type).dims()) + " to " +
                      std::string(dtype_name(out.dtype)));
    return EigenBackend::binary(op, a, b, out);
  }
  const View* views[2] = {&a, &b};
  execute(p, {{DNNL_ARG_SRC_0, views[src0]->data}, {DNNL_ARG_SRC_1, views[src1]->data}, {DNNL_ARG_DST, out.data}});
}

}  // namespace ruda::onednn
