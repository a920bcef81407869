// Everything of the engine in one include.
#pragma once

#include <ruda/attention.h>
#include <ruda/autograd.h>
#include <ruda/backend.h>
#include <ruda/dtype.h>
#include <ruda/error.h>
#include <ruda/gradcheck.h>
#include <ruda/memory.h>
#include <ruda/random.h>
#include <ruda/shape.h>
#include <ruda/tensor.h>
#include <ruda/thread_flag.h>
