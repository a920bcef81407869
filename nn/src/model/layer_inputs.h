// Input checks the layers share, dense and fully sharded alike (a sharded layer checks before its
// gathers, so a bad input costs no collective).
#pragma once

#include <ruda/error.h>
#include <ruda/tensor.h>

namespace ruda::nn::layer_inputs {

// An undefined input named by the layer (it read "dtype: called on an undefined tensor").
inline void require_input(const char* layer, const Tensor& x) {
  if (!x.defined()) fail<ArgumentError>(layer, "the input tensor is undefined");
}

// A layer that computes in floating point takes a floating input: an integer or bool one was cast
// to the weights' dtype without a word (PyTorch refuses it; LayerNorm here did already).
inline void require_float_input(const char* layer, const Tensor& x) {
  require_input(layer, x);
  if (!is_floating(x.dtype())) {
    fail<DTypeError>(layer, "needs a floating-point input, got ", dtype_name(x.dtype()), " ", x.shape(),
                     " (cast it first)");
  }
}

}  // namespace ruda::nn::layer_inputs
