// Every file of tests/data/safetensors-corpus (hand-made malformed files and whatever
// tools/fuzz-safetensors ever found) is read or refused with IOError: never a crash (the ASan
// and UBSan runs of the suite check the "never out of bounds" part).
#include <filesystem>

#include "helpers.h"

using namespace ruda;

TEST_CASE("the safetensors reader survives its corpus") {
  int files = 0, refused = 0;
  for (const auto& entry : std::filesystem::directory_iterator(RUDA_TEST_DATA "/safetensors-corpus")) {
    CAPTURE(entry.path().string());
    ++files;
    try {
      safetensors::Reader reader(entry.path().string());
      for (const auto& t : reader.tensors()) {
        const Tensor all = reader.read(t.name);
        CHECK(all.numel() == t.numel());
      }
    } catch (const IOError& e) {
      ++refused;
      CHECK(std::string(e.what()).find(entry.path().filename().string()) != std::string::npos);
    }
  }
  CHECK(files >= 10);
  CHECK(refused >= 8);  // every malformed hand-made file
}
