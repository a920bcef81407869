// libFuzzer target: any bytes as a safetensors file. The reader must either accept the file and
// read every tensor inside it, or raise IOError: never crash or read out of bounds.
// Built and run by tools/fuzz-safetensors (clang, -fsanitize=fuzzer,address,undefined).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include <ruda/nn/safetensors.h>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = ::memfd_create("fuzz.safetensors", 0);
  if (fd < 0) return 0;
  if (::write(fd, data, size) != static_cast<ssize_t>(size)) {
    ::close(fd);
    return 0;
  }
  try {
    ruda::safetensors::Reader reader("/proc/self/fd/" + std::to_string(fd));
    for (const auto& t : reader.tensors()) {
      if (t.numel() <= (1 << 20)) reader.read(t.name);
      if (t.numel() > 0) reader.read_range(t.name, t.numel() - 1, 1);
    }
  } catch (const ruda::IOError&) {
  }
  ::close(fd);
  return 0;
}
