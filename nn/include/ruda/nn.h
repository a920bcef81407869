// Everything of ruda's nn library: modules, layers, losses, optimizers, sharding.
#pragma once

#include <ruda/collectives.h>
#include <ruda/nn/checkpoint.h>
#include <ruda/nn/data.h>
#include <ruda/nn/grad_scaler.h>
#include <ruda/nn/init.h>
#include <ruda/nn/layers.h>
#include <ruda/nn/losses.h>
#include <ruda/nn/memory_plan.h>
#include <ruda/nn/module.h>
#include <ruda/nn/optim.h>
#include <ruda/nn/recompute.h>
#include <ruda/nn/safetensors.h>
#include <ruda/nn/sharded.h>
#include <ruda/nn/training.h>
#include <ruda/ruda.h>
