// Editing a checkpoint's index.json in tests. Since format version 3 the index carries a checksum
// of its own content ("index_xxh3"): an edit without it is refused as damage before any other
// check runs. Tests of those other checks edit the index as a tool writing a consistent but wrong
// index would (restamped), or as a checkpoint from before the checksum was (before_index_checksum).
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ruda::test {

/// j with its checksum recomputed: XXH3-64, as 16 hex digits, of the compact JSON without it.
inline nlohmann::json restamped(nlohmann::json j) {
  j.erase("index_xxh3");
  const std::string text = j.dump();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  j["index_xxh3"] = hex;
  return j;
}

/// j as format version 2 wrote it (or `version`, older still): no checksum of its own.
inline nlohmann::json before_index_checksum(nlohmann::json j, int version = 2) {
  j.erase("index_xxh3");
  j["version"] = version;
  return j;
}

}  // namespace ruda::test
