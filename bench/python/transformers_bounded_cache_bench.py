#!/usr/bin/env python3
"""Greedy generation of a random BLOOM-shaped transformers model under
poslsh.transformers.use_poslsh(method=--method, "plan" by default) with transformers' DynamicCache and with
poslsh.transformers.BoundedCache: --new tokens after a prompt of --prompt tokens, the two runs'
ids compared; prints the cache bytes of each after generation and the median time per generated
token (from a streamer's timestamps, the prefill excluded), min over --repeat runs of each,
the runs alternating.

    PYTHONPATH=python OMP_NUM_THREADS=1 python3 bench/python/transformers_bounded_cache_bench.py
    ... --method exact --prompt 16384 --layers 2   # exact heads: every key kept, no copy per token
"""

import argparse
import time

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import poslsh.transformers as pt


class Stamps(BaseStreamer):
    """The time of each put() (the prompt first, then one per generated token)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run(model, ids, new, cache):
    stamps = Stamps()
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, use_cache=True,
                   streamer=stamps, return_dict_in_generate=True)
    if cache is not None:
        options["cache"] = cache
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    steps = sorted(b - a for a, b in zip(stamps.times[1:-1], stamps.times[2:]))  # after the first token
    return out, steps[len(steps) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--method", default="plan",
                        help="use_poslsh's method for every head ('plan': the planner at 1%% error for the run's keys)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=1000, hidden_size=args.hidden, n_layer=args.layers,
                                      n_head=args.heads, initializer_range=0.5, attn_implementation="eager")
    model = transformers.BloomForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    total = args.prompt + args.new
    pt.use_poslsh(model, method=args.method, **({"plan_length": total} if args.method == "plan" else {}))
    ids = torch.randint(1, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    full_step = bounded_step = float("inf")
    for _ in range(args.repeat):
        full, step = run(model, ids, args.new, None)
        full_step = min(full_step, step)
        cache = pt.BoundedCache(model, total)
        bounded, step = run(model, ids, args.new, cache)
        bounded_step = min(bounded_step, step)
        if not torch.equal(full.sequences, bounded.sequences):
            raise SystemExit("the bounded cache's ids differ from DynamicCache's")
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.cache.layers)
    assert full_bytes == cache.full_cache_bytes()
    plans = pt._MODELS[model].groups(total, args.heads, args.hidden // args.heads)[0]
    methods = ", ".join(f"{g.method} x{len(g.kv_of)}" for g in plans)
    print(f"BLOOM-shaped: hidden {args.hidden}, {args.heads} heads, {args.layers} layers, {args.dtype}; method "
          f"{args.method!r} for {total} keys: {methods}")
    print(f"after {args.prompt} + {args.new} tokens: DynamicCache {full_bytes / 2**20:.2f} MiB, BoundedCache "
          f"{cache.bytes_in_use / 2**20:.2f} MiB ({100 * cache.bytes_in_use / full_bytes:.1f}%)")
    print(f"median time per token (min of {args.repeat} runs): DynamicCache {1e3 * full_step:.2f} ms, BoundedCache "
          f"{1e3 * bounded_step:.2f} ms ({bounded_step / full_step:.2f}x); the same {args.new} ids")


if __name__ == "__main__":
    main()
