// The portable CPU backend: every kernel for every dtype it makes sense for, on Eigen and plain
// vectorizable loops. Private header: the oneDNN backend derives from it to fall back on
// the kernels oneDNN lacks.
#pragma once

#include <ruda/backend.h>

namespace ruda {

class EigenBackend : public Backend {
 public:
  std::string_view name() const override { return "eigen"; }
  void fill(const View& out, double value) override;
  void copy(const View& src, const View& dst) override;
  void cast(const View& src, const View& dst) override;
  void unary(UnaryOp op, const View& x, const View& y) override;
  void unary_backward(UnaryOp op, const View& x, const View& y, const View& gy, const View& gx) override;
  void unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx) override;
  void add_scaled(const View& x, double alpha, const View& y) override;
  void binary(BinaryOp op, const View& a, const View& b, const View& out) override;
  void where(const View& cond, const View& a, const View& b, const View& out) override;
  void reduce(ReduceOp op, const View& x, const View& out) override;
  void gemm(const GemmDesc& desc) override;
  void softmax(const View& x, const View& y, int axis, bool log) override;
  void softmax_backward(const View& y, const View& gy, const View& gx, int axis, bool log) override;
  void gather_rows(const View& table, const View& index, const View& out) override;
  void scatter_add_rows(const View& src, const View& index, const View& table) override;
  void take_along_rows(const View& x, const View& index, const View& out) override;
  void put_add_along_rows(const View& src, const View& index, const View& x) override;
  void adam_update(const AdamDesc& desc) override;
  void layer_norm(const View& x, const View& weight, const View& bias, double eps, const View& y, const View& mean,
                  const View& rstd) override;
  void layer_norm_backward(const View& x, const View& weight, const View& mean, const View& rstd, const View& gy,
                           const View& gx, const View& gweight, const View& gbias) override;
  void attention(const AttentionDesc& desc) override;
  void attention_backward(const AttentionDesc& desc) override;

 private:
  // GemmDesc::epilogue on the result matrices at c (of `dtype`, laid out as d.c).
  void apply_epilogue(const GemmDesc& d, void* c, DType dtype);
};

}  // namespace ruda
