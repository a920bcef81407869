// Files as nn's checkpoints write and read them (internal to nn): text written atomically, text
// read only from a regular file of bounded size, and the crash simulation of the tests. The
// implementations share safetensors.cpp's atomic file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace ruda::safetensors {

/// Writes a text file atomically (temporary file, flush, rename), as write() does: a failure at any
/// point leaves no temporary behind. Errors read "checkpoint <path>: ...", as the checkpoint
/// code's own.
void write_text_atomically(const std::string& path, const std::string& text);
/// Reads a whole text file of at most `max_bytes`; IOError "checkpoint <path>: ..." if it is
/// missing, not a regular file (a directory, a FIFO: never blocks), or larger.
std::string read_text_file(const std::string& path, std::size_t max_bytes);

/// Parses JSON text (throwing the library's parse errors) with every object's keys checked to be
/// distinct: `duplicate` gets the first key an object repeats, "" if none.
nlohmann::json parse_distinct_keys(const std::string& text, std::string& duplicate);

namespace testing {
/// Crash simulation for tests: when RUDA_TEST_CRASH_AFTER_BYTES=N is set in the environment, a
/// write() that has written N bytes of its temporary file ends the process at once (_exit(86)),
/// as a kill would. Returns N, or -1 when unset.
std::int64_t crash_after_bytes();
}  // namespace testing

}  // namespace ruda::safetensors
