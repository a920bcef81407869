// What a Param handle needs from sharding (private to nn): model/module.cpp knows a sharded
// parameter only through these two calls, not through the groups and their schedule.
#pragma once

#include <ruda/nn/module.h>

namespace ruda::nn {

/// The logical (full) shape of a sharded parameter.
const Shape& sharded_logical_shape(const ShardInfo& info);
/// Param::value() of a sharded parameter: its group's gathered value, or a gather of its own.
Tensor sharded_value(const Param& param, const ShardInfo& info);

}  // namespace ruda::nn
