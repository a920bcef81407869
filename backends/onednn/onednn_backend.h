// The oneDNN backend: matmul, eltwise, binary, softmax and sum reductions as cached oneDNN
// primitives; everything oneDNN lacks, refuses or would compute differently runs on the Eigen
// kernels it derives from, each such case noted once (visible with RUDA_LOG=debug).
//
// Private header, free of oneDNN types: the primitives live in the process-wide cache of
// context.h, so one backend object serves every thread.
#pragma once

#include "eigen/eigen_backend.h"

namespace ruda::onednn {

class OneDnnBackend : public EigenBackend {
 public:
  std::string_view name() const override { return "onednn"; }

  // Run on oneDNN where it can.
  void gemm(const GemmDesc& desc) override;
  void unary(UnaryOp op, const View& x, const View& y) override;
  void unary_backward(UnaryOp op, const View& x, const View& y, const View& gy, const View& gx) override;
  void unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx) override;
  void binary(BinaryOp op, const View& a, const View& b, const View& out) override;
  void reduce(ReduceOp op, const View& x, const View& out) override;
  void softmax(const View& x, const View& y, int axis, bool log) override;
  void softmax_backward(const View& y, const View& gy, const View& gx, int axis, bool log) override;
  // The shared attention kernel with its block products on oneDNN matmuls (attention.cpp).
  void attention(const AttentionDesc& desc) override;
  void attention_backward(const AttentionDesc& desc) override;

  // Always on the Eigen kernels (oneDNN has no such primitive, or is no better): overridden only
  // to make that visible in the fallback log.
  void fill(const View& out, double value) override;
  void copy(const View& src, const View& dst) override;
  void cast(const View& src, const View& dst) override;
  void where(const View& cond, const View& a, const View& b, const View& out) override;
  void gather_rows(const View& table, const View& index, const View& out) override;
  void scatter_add_rows(const View& src, const View& index, const View& table) override;
  void take_along_rows(const View& x, const View& index, const View& out) override;
  void put_add_along_rows(const View& src, const View& index, const View& x) override;
  void adam_update(const AdamDesc& desc) override;
};

}  // namespace ruda::onednn
