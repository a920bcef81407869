// Fused scaled dot-product attention: validation, the forward kernel call, and a backward node that
// saves q, k, v, the output and the logsumexp (never the [Tq, Tk] weights).
#include <array>
#include <cmath>
#include <limits>

#include <ruda/attention.h>

#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;
using detail::view_of;

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";
constexpr const char* kPackedOp = "scaled_dot_product_attention_qkvpacked";

void validate(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o, const char* op = kOp) {
  for (const Tensor* t : {&q, &k, &v}) detail::require_defined(op, *t);
  const char* names[] = {"q", "k", "v"};
  const Tensor* ts[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    if (ts[i]->ndim() != 4) {
      fail<ShapeError>(op, names[i], " must be [batch, heads, time, dim], got ", ts[i]->shape(), " (q ", q.shape(),
                       ", k ", k.shape(), ", v ", v.shape(), ")");
    }
  }
  detail::require_float(op, q);
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    fail<DTypeError>(op, "q, k and v must share one dtype, got q ", dtype_name(q.dtype()), " ", q.shape(), ", k ",
                     dtype_name(k.dtype()), " ", k.shape(), ", v ", dtype_name(v.dtype()), " ", v.shape());
  }
  if (&k.backend() != &q.backend() || &v.backend() != &q.backend()) {
    fail<ArgumentError>(op, "q, k and v must be on one backend, got ", q.backend().name(), ", ", k.backend().name(),
                        " and ", v.backend().name());
  }
  const Shape &qs = q.shape(), &ks = k.shape(), &vs = v.shape();
  if (ks[0] != qs[0] || vs[0] != qs[0] || ks[1] != qs[1] || vs[1] != qs[1]) {
    fail<ShapeError>(op, "batch and heads differ: q ", qs, ", k ", ks, ", v ", vs);
  }
  if (ks[3] != qs[3]) fail<ShapeError>(op, "q and k head dimensions differ: q ", qs, ", k ", ks);
  if (vs[2] != ks[2]) fail<ShapeError>(op, "k and v lengths differ: k ", ks, ", v ", vs);
  if (qs[3] == 0) fail<ShapeError>(op, "needs a head dimension of at least 1: q ", qs);
  if (!(o.dropout >= 0.0 && o.dropout < 1.0)) {
    fail<ArgumentError>(op, "dropout probability must be in [0, 1), got ", o.dropout);
  }
  if (o.scale && !(std::isfinite(*o.scale) && *o.scale > 0)) {
    fail<ArgumentError>(op, "scale must be finite and positive, got ", *o.scale, " for q ", qs);
  }
  // Scores, statistics and the scale itself are f32 below f64: a scale that f32 turns into
  // infinity or 0 would give NaN weights without a word.
  if (o.scale && q.dtype() != DType::f64) {
    if (*o.scale > std::numeric_limits<float>::max() || *o.scale < std::numeric_limits<float>::denorm_min()) {
      fail<ArgumentError>(op, "scale ", *o.scale, " is outside f32's range, in which ", dtype_name(q.dtype()),
                          " attention computes (q ", qs, ")");
    }
  }
}

// The kernel reads any strides on the first three axes (a permuted [B, T, H, D] projection in
// place) but needs each row of D contiguous: a view without that is copied.
Tensor rows_contiguous(const Tensor& t) {
  const auto& impl = *detail::impl_of(t);
  return impl.shape[3] <= 1 || impl.strides[3] == 1 ? t : detail::dense(t);
}

// A gradient for `t` [B, H, T, D] laid out as t is: [B, T, H, D] storage when t's heads are
// interleaved in time (the permuted qkv projection), so that the permute, reshape and slice
// views that made t hand the gradient back to the projection without a copy. Heads expanded
// from one (stride 0, shared keys and values) keep the dense layout, which expand's backward
// (a sum over heads) reads without a copy.
Tensor gradient_like(const Tensor& t) {
  const Shape& s = t.shape();
  constexpr const char* kWhat = "scaled_dot_product_attention backward";
  const Shape strides = t.strides();
  if (strides[1] > 0 && strides[1] < strides[2]) {
    return make_tensor({s[0], s[2], s[1], s[3]}, t.dtype(), t.backend(), kWhat).permute({0, 2, 1, 3});
  }
  return make_tensor(s, t.dtype(), t.backend(), kWhat);
}

// The desc of options (the scale resolved against head dimension `dim`), without views.
AttentionDesc desc_of(const AttentionOptions& options, std::int64_t dim) {
  AttentionDesc desc;
  desc.causal = options.causal;
  desc.scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(dim));
  desc.dropout = options.dropout;
  desc.seed = options.seed;
  desc.offset = options.offset;
  return desc;
}

// Sets d's q, k, v (their rows made contiguous where they are not: the returned copies must
// outlive the kernel call), out and lse views.
std::array<Tensor, 3> set_views(AttentionDesc& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& lse) {
  std::array<Tensor, 3> rows{rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)};
  d.q = view_of(rows[0]);
  d.k = view_of(rows[1]);
  d.v = view_of(rows[2]);
  d.out = view_of(out);
  d.lse = view_of(lse);
  return rows;
}

// The forward kernel of validated q, k, v into out [B, H, Tq, Dv] (any strides, last axis
// contiguous) and lse [B, H, Tq].
void run_forward(AttentionDesc d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                 const Tensor& lse) {
  if (out.numel() == 0) return;
  if (k.shape()[2] == 0) {
    // No key: each query's weights are an empty set, its output the empty sum 0 (as PyTorch's
    // SDPA gives), and its logsumexp -inf. The kernel would divide 0 by an empty softmax's 0.
    Tensor(out).fill_(0);
    Tensor(lse).fill_(-std::numeric_limits<double>::infinity());
    return;
  }
  const auto rows = set_views(d, q, k, v, out, lse);
  q.backend().attention(d);
}

// The backward kernel: the gradients of q, k and v into dq, dk, dv (those defined; laid out as
// gradient_like or as views of one packed gradient), from the output gradient g [B, H, Tq, Dv].
void run_backward(AttentionDesc d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                  const Tensor& lse, const Tensor& g, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  if (g.numel() == 0 || k.shape()[2] == 0) {
    // No output values (Tq, Dv, B or H is 0), or no key (the output is 0 whatever q is): every
    // gradient is zero (k's and v's are empty then).
    for (const Tensor* t : {&dq, &dk, &dv}) {
      if (t->defined()) Tensor(*t).fill_(0);
    }
    return;
  }
  const auto rows = set_views(d, q, k, v, out, lse);
  const Tensor dout = rows_contiguous(g);  // any strides on the first three axes
  d.dout = view_of(dout);
  View none;
  none.dtype = q.dtype();
  d.dq = dq.defined() ? view_of(dq) : none;
  d.dk = dk.defined() ? view_of(dk) : none;
  d.dv = dv.defined() ? view_of(dv) : none;
  g.backend().attention_backward(d);
}

// Softmax statistics in f32 whatever the inputs' precision (f64 for f64).
DType stat_dtype(DType dtype) { return dtype == DType::f64 ? DType::f64 : DType::f32; }

// Part 0, 1 or 2 (q, k, v) of a [B, T, 3, H, D] tensor as [B, H, T, D]: a view, outside autograd.
Tensor packed_part(const Tensor& qkv, std::int64_t part) {
  autograd::NoGradGuard no_grad;
  return qkv.detach().slice(2, part, part + 1).squeeze(2).permute({0, 2, 1, 3});
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& options) {
  validate(q, k, v, options);
  const Shape& qs = q.shape();
  const std::int64_t batch = qs[0], heads = qs[1], tq = qs[2], dim = qs[3], dv = v.shape()[3];
  Backend& backend = q.backend();
  // The output is [B, H, Tq, Dv] laid out as [B, Tq, H, Dv] (a permuted view, as PyTorch's CPU
  // flash attention returns it): merging the heads back into [B, Tq, H * Dv] is then a view, and
  // the projection that follows saves the same storage this op saves for its backward.
  Tensor out = make_tensor({batch, tq, heads, dv}, q.dtype(), backend, kOp).permute({0, 2, 1, 3});
  Tensor lse = make_tensor({batch, heads, tq}, stat_dtype(q.dtype()), backend, kOp);
  const AttentionDesc desc = desc_of(options, dim);
  run_forward(desc, q, k, v, out, lse);
  if (autograd::needs_grad(q, k, v)) {
    autograd::record(kOp, out, {q, k, v}, {q, k, v, out, lse},
                     [desc](const Tensor& g, const Saved& s, GradMask need) {
                       Tensor dq, dk, dv;
                       if (need[0]) dq = gradient_like(rows_contiguous(s[0].get()));
                       if (need[1]) dk = gradient_like(rows_contiguous(s[1].get()));
                       if (need[2]) dv = gradient_like(rows_contiguous(s[2].get()));
                       run_backward(desc, s[0].get(), s[1].get(), s[2].get(), s[3].get(), s[4].get(), g, dq, dk, dv);
                       return std::vector<Tensor>{dq, dk, dv};
                     },
                     {.strided_grad = true});
  }
  return out;
}

Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, const AttentionOptions& options) {
  detail::require_defined(kPackedOp, qkv);
  if (qkv.ndim() != 5 || qkv.shape()[2] != 3) {
    fail<ShapeError>(kPackedOp, "qkv must be [batch, time, 3, heads, dim], got ", qkv.shape());
  }
  // What the three parts' own checks would refuse, named by qkv's shape rather than a part's.
  detail::require_float(kPackedOp, qkv);
  if (qkv.shape()[4] == 0) fail<ShapeError>(kPackedOp, "needs a head dimension of at least 1: qkv ", qkv.shape());
  const Tensor q = packed_part(qkv, 0), k = packed_part(qkv, 1), v = packed_part(qkv, 2);
  validate(q, k, v, options, kPackedOp);
  const Shape& s = qkv.shape();
  const std::int64_t batch = s[0], time = s[1], heads = s[3], dim = s[4];
  // [B, T, H, D] (FlashAttention's qkvpacked layout); the kernel writes it as [B, H, T, D].
  Tensor out = make_tensor({batch, time, heads, dim}, qkv.dtype(), qkv.backend(), kPackedOp);
  Tensor lse = make_tensor({batch, heads, time}, stat_dtype(qkv.dtype()), qkv.backend(), kPackedOp);
  const AttentionDesc desc = desc_of(options, dim);
  run_forward(desc, q, k, v, out.permute({0, 2, 1, 3}), lse);
  if (autograd::needs_grad(qkv)) {
    autograd::record(kPackedOp, out, {qkv}, {qkv, out, lse},
                     [desc](const Tensor& g, const Saved& saved, GradMask) {
                       // One [B, T, 3, H, D] gradient whose three parts the kernel writes in place:
                       // no per-part gradients to gather into the projection's afterwards.
                       const Tensor& x = saved[0].get();
                       const Tensor dqkv = make_tensor(x.shape(), x.dtype(), x.backend(), kPackedOp);
                       auto heads_of = [](const Tensor& t) { return t.permute({0, 2, 1, 3}); };
                       run_backward(desc, packed_part(x, 0), packed_part(x, 1), packed_part(x, 2),
                                    heads_of(saved[1].get()), saved[2].get(), heads_of(g), packed_part(dqkv, 0),
                                    packed_part(dqkv, 1), packed_part(dqkv, 2));
                       return std::vector<Tensor>{dqkv};
                     },
                     {.strided_grad = true});
  }
  return out;
}

}  // namespace ruda
