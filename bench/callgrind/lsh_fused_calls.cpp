// One call of lsh_attention_fused (one head, float, d = 64, causal, s = 16, the benchmark's
// inputs and seed) for counting instructions with callgrind, where valgrind cannot run the
// AVX-512 build: compiled for AVX2 (-march=x86-64-v3), so its products run on 8-float packets,
// not the 16-float packets of the -march=native build (a different code path: instruction
// shares between the phases, not the native build's counts). Not part of the CMake build:
//   g++ -std=c++17 -O2 -DNDEBUG -march=x86-64-v3 -g -fno-omit-frame-pointer -Iinclude \
//       -I/usr/include/eigen3 bench/callgrind/lsh_fused_calls.cpp -o /tmp/lsh_fused_calls
//   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p /tmp/lsh_fused_calls SIGMA [N]
//   callgrind_annotate --inclusive=yes /tmp/cg.<pid> | head -60
// Built without OpenMP: one thread runs the query tiles one after the other.
#include <cstdio>
#include <cstdlib>
#include <poslsh/poslsh.hpp>

#include "../bench_inputs.hpp"

int main(int argc, char** argv) {
  namespace pb = poslsh::bench;
  const double sigma = argc > 1 ? std::atof(argv[1]) : 16.0;
  const poslsh::Index n = argc > 2 ? std::atol(argv[2]) : 4096;
  const pb::Tensor q(pb::Which::q, n), k(pb::Which::k, n), v(pb::Which::v, n);
  pb::Tensor out(pb::Which::out, n);
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, pb::default_samples, pb::seed);
  auto out_h = out.view().head(0);
  poslsh::lsh_attention_fused<float>(q.view().head(0), k.view().head(0), v.view().head(0), hashes,
                                     out_h);
  const long long pairs = poslsh::lsh_fused_pair_count(hashes, n, poslsh::Masking::causal);
  std::printf("sigma %g n %ld pairs %lld out[0] %g\n", sigma, static_cast<long>(n), pairs,
              static_cast<double>(out.data()[0]));
  return 0;
}
