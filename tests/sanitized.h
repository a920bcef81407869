// RUDA_TEST_SANITIZED: defined in a build under AddressSanitizer or ThreadSanitizer (GCC's and
// Clang's spellings), for the few tests whose measurement a sanitizer changes (an address-space
// limit stops the sanitizer itself; its allocator holds freed memory back).
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RUDA_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define RUDA_TEST_SANITIZED 1
#endif
#endif
