"""Cost of the Python binding: multihead_attention (fused LSH) from Python vs from C++.

The call: n = 4096 tokens, H = 8 heads, d = 64, float32 [n, H, d] buffers, ALiBi sigmas,
s = 16 samples, seed 2024, causal (the benchmark suite's lsh_fused/4096 row). Python times the
call with a preallocated out= (as the C++ program does) and with a new output array each call;
the C++ program (bench/python/bench_binding_cpp.cpp, target poslsh_bench_binding_cpp) times the same
call in C++. Rounds alternate between the two so that both see the same machine load; each
figure is the minimum over all calls.

    cmake --build build-py --target poslsh_bench_binding_cpp
    PYTHONPATH=build-py/python python3 bench/python/bench_binding.py \
        --cpp build-py/python/bench/poslsh_bench_binding_cpp
"""

import argparse
import subprocess
import time

import numpy as np

import poslsh


def time_python(call, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def time_cpp(program, n, heads, d, repeats):
    line = subprocess.run([program, str(n), str(heads), str(d), str(repeats)], check=True,
                          capture_output=True, text=True).stdout
    fields = line.split()
    assert fields[0] == "cpp_ms", line
    return float(fields[1]), float(fields[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30, help="calls per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cpp", help="path of poslsh_bench_binding_cpp")
    parser.add_argument("--small-n", type=int, default=64,
                        help="n of the per-call overhead measurement (0: skip it)")
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    shape = (args.n, args.heads, args.d)
    q, k, v = (rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(3))
    out = np.empty(shape, dtype=np.float32)

    def with_out():
        poslsh.multihead_attention(q, k, v, samples=16, seed=2024, out=out)

    def new_output():
        poslsh.multihead_attention(q, k, v, samples=16, seed=2024)

    with_out()
    new_output()
    python_out, python_new, cpp = [], [], []
    for _ in range(args.rounds):
        if args.cpp:
            cpp.append(time_cpp(args.cpp, args.n, args.heads, args.d, args.repeats)[0])
        python_out += time_python(with_out, args.repeats)
        python_new += time_python(new_output, args.repeats)

    print(f"multihead_attention lsh_fused, n = {args.n}, H = {args.heads}, d = {args.d}, float32, "
          f"s = 16, causal, {poslsh.max_threads()} threads; min of {args.rounds} x {args.repeats} calls")
    best_out, best_new = min(python_out), min(python_new)
    print(f"python, out= preallocated : {best_out:8.3f} ms (median {np.median(python_out):.3f})")
    print(f"python, new output array  : {best_new:8.3f} ms (median {np.median(python_new):.3f})")
    if cpp:
        best_cpp = min(cpp)
        print(f"c++ (same call)           : {best_cpp:8.3f} ms (min of the rounds' minima {cpp})")
        print(f"ratio python(out=) / c++  : {best_out / best_cpp:.4f}")
        print(f"ratio python(new)  / c++  : {best_new / best_cpp:.4f}")
    if cpp and args.small_n > 0:
        # The binding's cost is per call (argument checks, views, GIL, output): measured on a
        # small problem, where it is not hidden by the kernel's time, as the difference of the
        # Python and C++ minima over many calls.
        small = (args.small_n, args.heads, args.d)
        qs, ks, vs = (rng.uniform(-1, 1, small).astype(np.float32) for _ in range(3))
        outs = np.empty(small, dtype=np.float32)

        def small_call():
            poslsh.multihead_attention(qs, ks, vs, samples=16, seed=2024, out=outs)

        small_call()
        calls = 2000
        python_small = min(min(time_python(small_call, calls)) for _ in range(3))
        cpp_small = min(time_cpp(args.cpp, args.small_n, args.heads, args.d, calls)[0] for _ in range(3))
        overhead = python_small - cpp_small
        print(f"n = {args.small_n}: python {1e3 * python_small:.1f} us, c++ {1e3 * cpp_small:.1f} us, "
              f"binding overhead {1e3 * overhead:.1f} us per call")
        print(f"overhead / c++ time at n = {args.n}: {overhead / best_cpp:.2e} "
              f"(ratio {1 + overhead / best_cpp:.5f})")


if __name__ == "__main__":
    main()
