// Every public header under a strict user's warnings (README: the headers are warning-free there).
// Compiled only: a warning in a header fails the consumer build (-Werror).
#include <ruda/attention.h>
#include <ruda/autograd.h>
#include <ruda/backend.h>
#include <ruda/collectives.h>
#include <ruda/dtype.h>
#include <ruda/error.h>
#include <ruda/gradcheck.h>
#include <ruda/memory.h>
#include <ruda/nn.h>
#include <ruda/nn/checkpoint.h>
#include <ruda/nn/data.h>
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
#include <ruda/random.h>
#include <ruda/ruda.h>
#include <ruda/shape.h>
#include <ruda/tensor.h>
#include <ruda/thread_flag.h>
