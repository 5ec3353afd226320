// Driver of poslsh_fuzz where libFuzzer is not available (a compiler other than clang): feeds
// LLVMFuzzerTestOneInput random byte strings from a fixed seed, a bounded randomized property
// test. Flags as libFuzzer's: -runs=N (default 10000), -max_total_time=S, -seed=N; other
// arguments are files replayed once each (a crash input saved by libFuzzer, for instance).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv) {
  long long runs = 10000;
  double max_seconds = 0.0;
  std::uint64_t seed = 1;
  std::vector<std::string> files;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg.rfind("-runs=", 0) == 0) {
      runs = std::atoll(arg.c_str() + 6);
    } else if (arg.rfind("-max_total_time=", 0) == 0) {
      max_seconds = std::atof(arg.c_str() + 16);
      runs = -1;
    } else if (arg.rfind("-seed=", 0) == 0) {
      seed = std::strtoull(arg.c_str() + 6, nullptr, 10);
    } else if (arg.rfind('-', 0) == 0) {
      std::fprintf(stderr, "poslsh_fuzz: ignoring flag %s\n", arg.c_str());
    } else {
      files.push_back(arg);
    }
  }
  if (!files.empty()) {
    for (const std::string& file : files) {
      std::ifstream in(file, std::ios::binary);
      const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                            std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    }
    std::printf("poslsh_fuzz: replayed %zu inputs\n", files.size());
    return 0;
  }
  std::mt19937_64 engine(seed);
  const auto start = std::chrono::steady_clock::now();
  long long done = 0;
  std::vector<std::uint8_t> bytes;
  for (;; ++done) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (runs >= 0 ? done >= runs : elapsed >= max_seconds) break;
    bytes.resize(static_cast<std::size_t>(engine() % 257));
    for (std::uint8_t& byte : bytes) byte = static_cast<std::uint8_t>(engine());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("poslsh_fuzz: %lld inputs tried in %.1f s (seed %llu), no property violated\n", done,
              elapsed, static_cast<unsigned long long>(seed));
  return 0;
}
