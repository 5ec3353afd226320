#!/usr/bin/env python3
"""Forward + backward time of ``flash_attn_func`` training calls, for calls with fewer queries than
keys (seqlen_q < seqlen_k) among others.

    PYTHONPATH=build-py/python python3 bench/python/flash_training_bench.py \\
        --shapes 2x512x4096 32x64x128 64x16x32 [--method exact] [--repeats 5]

Each shape is batch x seqlen_q x seqlen_k, with 8 heads, head dim 64, float32, causal, the
official ALiBi slopes of 8 heads; one warm-up step, then --repeats timed steps of
``flash_attn_func`` and ``torch.autograd.grad`` of q, k, v for a fixed dout; the best is printed
with the absolute sum of the gradients (equal sums from two builds show that they computed the
same gradients). Compare two builds by running the script with each on PYTHONPATH, alternating.
"""

import argparse
import time

import torch

from poslsh.flash import flash_attn_func


def step_time(batch, seqlen_q, seqlen_k, method, repeats, heads=8, dim=64):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((batch, length, heads, dim), generator=generator).requires_grad_()
               for length in (seqlen_q, seqlen_k, seqlen_k))
    dout = torch.randn((batch, seqlen_q, heads, dim), generator=generator)
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(heads)])

    def step():
        out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method)
        return torch.autograd.grad(out, (q, k, v), dout)

    step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        grads = step()
        best = min(best, time.perf_counter() - start)
    return best, float(sum(g.double().abs().sum() for g in grads))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["2x512x4096", "32x64x128", "64x16x32"])
    parser.add_argument("--method", default="exact")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for shape in args.shapes:
        batch, seqlen_q, seqlen_k = (int(x) for x in shape.split("x"))
        seconds, total = step_time(batch, seqlen_q, seqlen_k, args.method, args.repeats)
        print(f"{shape} {args.method}: best {seconds * 1e3:.1f} ms, sum |grad| {total:.17g}")


if __name__ == "__main__":
    main()
