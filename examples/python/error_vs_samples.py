"""Error of LSH attention against exact ALiBi attention for s = 1 .. 256 samples.

The Python counterpart of examples/quickstart.cpp: one head, n = 4096, d = 64, sigma = 16,
causal, float32. For each s, the relative Frobenius error of the fused LSH estimate
T~ = D~^-1 (A o M~) V against the exact T* = softmax(QK^T / sqrt(d) - |i-j| / sigma) V, and the
(query, key) pairs the fused kernel evaluates per query.

    PYTHONPATH=build-py/python python3 examples/python/error_vs_samples.py
"""

import argparse
import time

import numpy as np

import poslsh


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=16.0)
    parser.add_argument("--max-samples", type=int, default=256)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.uniform(-1, 1, (args.n, args.d)).astype(np.float32) for _ in range(3))

    start = time.perf_counter()
    exact = poslsh.alibi_attention_tiled(q, k, v, args.sigma)
    exact_ms = 1e3 * (time.perf_counter() - start)
    norm = np.linalg.norm(exact)

    print(f"n = {args.n}, d = {args.d}, sigma = {args.sigma:g}, causal, float32")
    print(f"{'samples':>8} {'rel. error':>12} {'pairs/query':>12} {'ms':>8}")
    s = 1
    while s <= args.max_samples:
        hashes = poslsh.rbf_hashes(args.sigma, s, seed=args.seed, stream=0)
        start = time.perf_counter()
        approx = poslsh.lsh_attention_fused(q, k, v, hashes)
        ms = 1e3 * (time.perf_counter() - start)
        pairs = poslsh.lsh_fused_pair_count(hashes, args.n) / args.n
        print(f"{s:>8} {np.linalg.norm(approx - exact) / norm:>12.4f} {pairs:>12.1f} {ms:>8.2f}")
        s *= 2
    print(f"exact attention: {(args.n + 1) / 2:.1f} pairs per query, {exact_ms:.2f} ms")


if __name__ == "__main__":
    main()
