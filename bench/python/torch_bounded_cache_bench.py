#!/usr/bin/env python3
"""One AlibiSelfAttention layer (hidden 512, 8 heads, Press et al.'s slopes, method "banded")
decoding through poslsh.torch.KVCache and through poslsh.torch.BoundedKVCache side by side:
chunked prefill of --prefill tokens (chunks of 1024), then one token at a time up to --length,
every output compared bitwise between the two caches; prints the bounded cache's bytes against
the full cache's and the median time per decode step of each.

    PYTHONPATH=python python3 bench/python/torch_bounded_cache_bench.py --length 8192 --prefill 7168
"""

import argparse
import time

import torch

import poslsh.torch as pt


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--prefill", type=int, default=7168)
    parser.add_argument("--method", default="banded")
    args = parser.parse_args()
    torch.manual_seed(0)
    attn = pt.AlibiSelfAttention(512, 8, 8, method=args.method)
    n = args.length
    full = pt.KVCache.for_module(attn, 1, n)
    bounded = pt.KVCache.for_module(attn, 1, n, bounded=True)
    x = torch.randn(1, n, 512)
    full_times, bounded_times = [], []
    with torch.no_grad():
        for a in range(0, args.prefill, 1024):
            b = min(a + 1024, args.prefill)
            if not torch.equal(attn(x[:, a:b], cache=full), attn(x[:, a:b], cache=bounded)):
                raise SystemExit(f"prefill chunk {a}..{b}: outputs differ")
        for t in range(args.prefill, n):
            start = time.perf_counter()
            want = attn(x[:, t:t + 1], cache=full)
            full_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            got = attn(x[:, t:t + 1], cache=bounded)
            bounded_times.append(time.perf_counter() - start)
            if not torch.equal(got, want):
                raise SystemExit(f"decode step {t}: outputs differ")
    full_times.sort()
    bounded_times.sort()
    held, every = bounded.bytes_in_use, bounded.full_cache_bytes()
    print(f"t = {n}: bounded cache {held / 2**20:.2f} MiB, full cache {every / 2**20:.2f} MiB "
          f"({100 * held / every:.1f}%); median decode step: full {1e3 * full_times[len(full_times) // 2]:.3f} ms, "
          f"bounded {1e3 * bounded_times[len(bounded_times) // 2]:.3f} ms; {n - args.prefill} decode steps bitwise "
          "equal")


if __name__ == "__main__":
    main()
