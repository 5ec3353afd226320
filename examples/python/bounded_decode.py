"""Decoding on a bounded KV cache from Python: a BLOOM-7b1-shaped attention layer.

The Python counterpart of examples/bounded_decode.cpp, shorter: 32 query and K/V heads,
d = 128, the ALiBi slopes, the heads planned at a 1% output error (plan_heads); a prefill
chunk, then tokens decoded one by one on a poslsh._core.BoundedKVCache (float32 pages of 256
positions), printing the cache's bytes against a full cache's. Every --check-every steps the
step's output is compared with multihead_attention over every key (bitwise equal).

    PYTHONPATH=build-py/python python3 examples/python/bounded_decode.py --tokens 20000
"""

import argparse
import time

import numpy as np

import poslsh
from poslsh._core import BoundedKVCache

HEADS, DIM, PAGE = 32, 128, 256


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--target", type=float, default=0.01)
    parser.add_argument("--check-every", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()

    plans = poslsh.plan_heads(1 << 20, poslsh.alibi_sigmas(HEADS), args.target, head_dim=DIM)
    print(poslsh.format_plan(plans, 1 << 20), end="")
    # Room for the widest head's band and the prefill chunk, per head.
    widest = max(p.band for p in plans if p.method == "exact_banded")
    pages = HEADS * ((widest + args.prefill) // PAGE + 3)
    cache = BoundedKVCache(HEADS, DIM, DIM, PAGE, pages, plans=plans)
    seq = cache.open()

    rng = np.random.default_rng(args.seed)
    pool = 4096  # token t takes row t % pool of these random tokens
    q, k, v = (rng.standard_normal((pool, HEADS, DIM)).astype(np.float32) for _ in range(3))

    def rows(x, first, count):
        return np.take(x, np.arange(first, first + count) % pool, axis=0)

    cache.append(seq, 0, rows(k, 0, args.prefill), rows(v, 0, args.prefill))
    cache.attention(rows(q, 0, args.prefill), [seq])
    start, steps = time.perf_counter(), 0
    for t in range(args.prefill, args.tokens):
        cache.append(seq, t, rows(k, t, 1), rows(v, t, 1))
        out = cache.attention(rows(q, t, 1), [seq])
        steps += 1
        if (t + 1) % args.check_every == 0 or t + 1 == args.tokens:
            full = poslsh.multihead_attention(rows(q, t, 1), rows(k, 0, t + 1), rows(v, 0, t + 1),
                                              query_offset=t, plans=plans)
            per_token = (time.perf_counter() - start) / steps
            print(f"t = {t + 1:7d}  cache {cache.bytes_in_use / 2**20:7.1f} MiB  full cache "
                  f"{cache.full_cache_bytes(seq) / 2**20:8.1f} MiB  "
                  f"{1e6 * per_token:7.0f} us/token  bitwise: {np.array_equal(out, full)}")
            start, steps = time.perf_counter(), 0


if __name__ == "__main__":
    main()
