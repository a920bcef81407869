#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

// Tests ask for sizes no machine has, to check that they become OutOfMemoryError: under the
// sanitizers, whose allocators abort on such requests by default, the allocation must fail as the
// system's does (return null) instead. Read only by sanitizer runtimes.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
extern "C" const char* __tsan_default_options() { return "allocator_may_return_null=1"; }
