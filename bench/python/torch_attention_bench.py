#!/usr/bin/env python3
"""PyTorch-level benchmarks of poslsh.torch: the FlashAttention-style wrapper's overhead, and poslsh
against PyTorch's own dense ALiBi attention (as Hugging Face's BLOOM computes it).

    PYTHONPATH=build-py/python python3 bench/python/torch_attention_bench.py [--threads 2] [--markdown out.md]
    ... --part overhead        # (a) only
    ... --part dense --lengths 4096 8192 16384

(a) Overhead: ``flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)`` against the direct
    ``poslsh.torch.multihead_attention(q[0], k[0], v[0], method="exact_tiled", sigmas=1/slopes)``
    at batch 1, seqlen 4096, 8 heads, head dim 64, float32, forward (under torch.no_grad()).
    The two calls alternate for --rounds rounds (--calls calls each per round); the table gives
    the median time per call of each and the median of the per-round ratios wrapper / direct.
    The same at seqlen 16 (200 calls a round, one thread), where the kernels cost little, gives the
    wrapper's fixed cost per call, also as a share of the seqlen-4096 call.
(b) Dense comparison: batch 1, 8 heads, head dim 64, float32, causal, every --lengths value;
    for poslsh's exact and LSH methods (flash_attn_func, method "exact" and --lsh-method) and for
    dense PyTorch, the forward (torch.no_grad()) and the forward + backward (loss = (out * g).sum()
    over a fixed random g; time from the call to the end of backward). Dense PyTorch as BLOOM's
    eager attention: the alibi tensor slope_h * j (BH, 1, L) and the causal mask built once
    outside the timed region, then per call the (B, L, H, d) -> (BH, L, d) copies, ``baddbmm``
    (alibi + scale Q K^T), ``masked_fill`` with the dtype's minimum, ``softmax`` and ``bmm``.
    Each configuration runs in a fresh child process (poslsh: one warm-up call, then --repeats
    timed calls, median reported; dense: one warm-up call at L = 256, then --dense-repeats timed
    calls, since every call allocates and faults in its L^2 tensors anew); its peak memory is the
    child's ``ru_maxrss`` (peak RSS), also given above the child's RSS once torch is imported and
    the inputs exist (the baseline).
    Dense configurations whose estimated memory (3 (forward) or 4 (forward + backward) tensors
    of H L^2 floats) exceeds --memory-limit-gib are not run and are reported as out of memory
    with the estimate; the children run under an address-space limit of that size plus
    --headroom-gib, so an underestimate ends in a MemoryError instead of exhausting the machine.

Every measurement runs in a child process with --threads threads for torch
(torch.set_num_threads) and poslsh (OMP_NUM_THREADS), default 2, and the default allocator: a
dense (H, L, L) tensor is a fresh mmap on every call, so its pages are faulted in every time
(part of what materialising the scores costs; expensive on a virtual machine).
"""

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

HEADS, HEAD_DIM = 8, 64
GIB = 1024 ** 3


def estimate_dense_bytes(length, backward):
    """Memory of dense PyTorch attention: (H, L, L) float32 tensors alive at once, 3 in the
    forward (scores, masked scores, probabilities), 4 with the backward (probabilities saved,
    their gradient, the gradient of the scores, its masked copy)."""
    return (4 if backward else 3) * HEADS * length * length * 4


# ----------------------------------------------------------------------------------------------
# Calls


def flash_call(ptorch, method, lsh_samples):
    def call(q, k, v, slopes):
        return ptorch.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method,
                                      samples=lsh_samples)
    return call


def direct_call(ptorch):
    def call(q, k, v, slopes):
        sigmas = [1.0 / float(s) for s in slopes]
        return ptorch.multihead_attention(q[0], k[0], v[0], layout="nhd", method="exact_tiled", masking="causal",
                                          sigmas=sigmas)
    return call


def dense_setup(torch, slopes, length):
    """BLOOM's alibi (BH, 1, L) = slope_h * j and the causal mask (L, L), built once."""
    alibi = slopes[:, None, None] * torch.arange(length, dtype=torch.float32)[None, None, :]
    causal_mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    return alibi, causal_mask


def dense_call(torch, alibi, causal_mask):
    def call(q, k, v, slopes):
        batch, length, heads, dim = q.shape
        query = q.transpose(1, 2).reshape(batch * heads, length, dim)
        key = k.transpose(1, 2).reshape(batch * heads, length, dim)
        value = v.transpose(1, 2).reshape(batch * heads, length, dim)
        scores = alibi.baddbmm(query, key.transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(dim))
        scores = scores.view(batch, heads, length, length)
        weights = scores.masked_fill(causal_mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(weights, dim=-1, dtype=torch.float32)
        out = torch.bmm(probs.view(batch * heads, length, length), value)
        return out.view(batch, heads, length, dim).transpose(1, 2)
    return call


def inputs(torch, length, requires_grad=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, length, HEADS, HEAD_DIM, generator=generator) for _ in range(3))
    if requires_grad:
        for x in (q, k, v):
            x.requires_grad_(True)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# (a) wrapper overhead


def alternate(torch, calls, q, k, v, slopes, rounds, per_round):
    """Median seconds per call of each of `calls` and the median of the rounds' ratios
    first / second, the calls alternating round by round."""
    times = {name: [] for name in calls}
    ratios = []
    with torch.no_grad():
        for _ in range(rounds):
            round_times = {}
            for name, call in calls.items():
                started = time.perf_counter()
                for _ in range(per_round):
                    call(q, k, v, slopes)
                round_times[name] = (time.perf_counter() - started) / per_round
                times[name].append(round_times[name])
            first, second = calls
            ratios.append(round_times[first] / round_times[second])
    result = {name: statistics.median(values) for name, values in times.items()}
    result.update(ratio=statistics.median(ratios), ratios=ratios)
    return result


def overhead(args):
    """(a): the two calls at --overhead-length, and at seqlen 16 (where the kernels cost little, so
    the difference per call is the wrapper's fixed cost)."""
    import torch
    import poslsh.torch as ptorch
    torch.set_num_threads(args.threads)
    slopes = ptorch.make_alibi_slopes(HEADS)
    calls = {"flash_attn_func": flash_call(ptorch, "exact", args.samples), "multihead_attention": direct_call(ptorch)}
    q, k, v = inputs(torch, args.overhead_length)
    with torch.no_grad():
        difference = (calls["flash_attn_func"](q, k, v, slopes)[0] - calls["multihead_attention"](q, k, v, slopes))
    result = alternate(torch, calls, q, k, v, slopes, args.rounds, args.calls)
    result["max_abs_difference"] = difference.abs().max().item()
    small = inputs(torch, 16)
    torch.set_num_threads(1)          # no thread wake-ups: the difference is the Python-side cost
    tiny = alternate(torch, calls, *small, slopes, args.rounds, 200)
    result["fixed_cost"] = tiny["flash_attn_func"] - tiny["multihead_attention"]
    result["small"] = tiny
    return result


# ----------------------------------------------------------------------------------------------
# (b) one configuration, in a child process


def child(args):
    """Runs one configuration and prints a JSON line: median seconds, peak RSS, baseline RSS."""
    import torch
    import poslsh.torch as ptorch
    torch.set_num_threads(args.threads)
    backward = args.child_mode == "fwd_bwd"
    length = args.child_length
    slopes = ptorch.make_alibi_slopes(HEADS)
    q, k, v = inputs(torch, length, requires_grad=backward)
    grad = torch.randn(1, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)) if backward else None
    if args.child_impl == "overhead":
        print(json.dumps(overhead(args)))
        return 0
    if args.child_impl == "dense":
        small = inputs(torch, 256, requires_grad=backward)      # library and thread start-up, off the clock
        out = dense_call(torch, *dense_setup(torch, slopes, 256))(*small, slopes)
        if backward:
            out.sum().backward()
        alibi, causal_mask = dense_setup(torch, slopes, length)
        call = dense_call(torch, alibi, causal_mask)
    else:
        call = flash_call(ptorch, args.child_impl, args.samples)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def once():
        if backward:
            for x in (q, k, v):
                x.grad = None
            (call(q, k, v, slopes) * grad).sum().backward()
        else:
            with torch.no_grad():
                call(q, k, v, slopes)

    seconds = []
    warm_up = args.child_impl != "dense"
    for index in range(args.repeats + warm_up):
        started = time.perf_counter()
        once()
        if index or not warm_up:                       # poslsh: the first call is the warm-up
            seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(seconds=statistics.median(seconds), all_seconds=seconds, peak=peak, baseline=baseline)))
    return 0


def child_env(args):
    """The children's environment: --threads OpenMP threads."""
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads))


def run_overhead(args):
    command = [sys.executable, os.path.abspath(__file__), "--child-impl", "overhead", "--child-length",
               str(args.overhead_length), "--child-mode", "fwd", "--threads", str(args.threads), "--rounds",
               str(args.rounds), "--calls", str(args.calls), "--overhead-length", str(args.overhead_length)]
    done = subprocess.run(command, env=child_env(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"torch_attention_bench: the overhead run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(args, impl, length, mode):
    """The configuration's result dict, or {"oom": ...} (estimate or failure)."""
    limit = None
    if impl == "dense":
        estimate = estimate_dense_bytes(length, mode == "fwd_bwd")
        if estimate > args.memory_limit_gib * GIB:
            return dict(oom=True, estimate=estimate, ran=False)
        limit = int((args.memory_limit_gib + args.headroom_gib) * GIB)

    def limit_memory():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    command = [sys.executable, os.path.abspath(__file__), "--child-impl", impl, "--child-length", str(length),
               "--child-mode", mode, "--threads", str(args.threads),
               "--repeats", str(args.dense_repeats if impl == "dense" else args.repeats),
               "--samples", str(args.samples)]
    env = child_env(args)
    done = subprocess.run(command, env=env, capture_output=True, text=True, preexec_fn=limit_memory)
    if done.returncode != 0:
        text = done.stderr.strip().splitlines()
        reason = text[-1] if text else f"exit status {done.returncode}"
        memory = "MemoryError" in done.stderr or "alloc" in done.stderr.lower() or done.returncode < 0
        return dict(oom=memory, failed=reason, ran=True,
                    estimate=estimate_dense_bytes(length, mode == "fwd_bwd") if impl == "dense" else None)
    return json.loads(done.stdout.strip().splitlines()[-1])


def dense_comparison(args, log):
    rows = []
    impls = [("poslsh exact", "exact"), (f"poslsh {args.lsh_method} (s = {args.samples})", args.lsh_method),
             ("dense PyTorch (BLOOM)", "dense")]
    for length in args.lengths:
        for mode in ("fwd", "fwd_bwd"):
            for label, impl in impls:
                result = run_child(args, impl, length, mode)
                rows.append(dict(length=length, mode=mode, label=label, impl=impl, **result))
                log(json.dumps(rows[-1]))
    return rows


# ----------------------------------------------------------------------------------------------
# Report


def mib(value):
    return f"{value / 2 ** 20:,.0f}"


def markdown(args, over, rows):
    lines = [f"Threads: {args.threads}; batch 1, {HEADS} heads, head dim {HEAD_DIM}, float32, causal.", ""]
    if over:
        lines += [f"(a) Forward at seqlen {args.overhead_length}, medians of {args.rounds} alternating rounds of "
                  f"{args.calls} calls:", "",
                  "| call | ms per call |", "|---|---|",
                  f"| `flash_attn_func(..., method=\"exact\")` | {over['flash_attn_func'] * 1e3:.1f} |",
                  f"| `multihead_attention(..., method=\"exact_tiled\")` | "
                  f"{over['multihead_attention'] * 1e3:.1f} |",
                  f"| ratio wrapper / direct (median of the rounds' ratios) | {over['ratio']:.3f} |", "",
                  f"Largest difference between the two outputs: {over['max_abs_difference']:.2e}. At seqlen 16 "
                  f"(200 calls a round, one thread) the calls take {over['small']['flash_attn_func'] * 1e6:.0f} and "
                  f"{over['small']['multihead_attention'] * 1e6:.0f} us: the wrapper's fixed cost is "
                  f"{over['fixed_cost'] * 1e6:.0f} us per call, "
                  f"{100 * over['fixed_cost'] / over['multihead_attention']:.2f}% of the seqlen "
                  f"{args.overhead_length} call.", ""]
    if rows:
        lines += [f"(b) poslsh: median of {args.repeats} calls after one warm-up; dense PyTorch: median of "
                  f"{args.dense_repeats} calls after a warm-up at seqlen 256; each configuration in a fresh process; "
                  "peak RSS of that process (MiB), in parentheses above its RSS with torch imported and the inputs "
                  "allocated.", "",
                  "| seqlen | pass | implementation | time (s) | vs dense | peak RSS (MiB) |",
                  "|---|---|---|---|---|---|"]
        dense = {(r["length"], r["mode"]): r for r in rows if r["impl"] == "dense"}
        for r in rows:
            pass_name = "forward" if r["mode"] == "fwd" else "forward + backward"
            if "seconds" in r:
                base = dense.get((r["length"], r["mode"]))
                speed = f"{base['seconds'] / r['seconds']:.1f}x" if base and "seconds" in base and \
                    r["impl"] != "dense" else ("1.0x" if r["impl"] == "dense" else "-")
                memory = f"{mib(r['peak'])} ({mib(r['peak'] - r['baseline'])})"
                lines.append(f"| {r['length']} | {pass_name} | {r['label']} | {r['seconds']:.2f} | {speed} | "
                             f"{memory} |")
            elif r.get("oom") and not r.get("ran"):
                lines.append(f"| {r['length']} | {pass_name} | {r['label']} | out of memory (estimated "
                             f"{r['estimate'] / GIB:.1f} GiB > {args.memory_limit_gib:g} GiB; not run) | - | - |")
            else:
                lines.append(f"| {r['length']} | {pass_name} | {r['label']} | failed: {r.get('failed')} | - | - |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("overhead", "dense", "all"), default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=11, help="(a) alternating rounds")
    p.add_argument("--calls", type=int, default=3, help="(a) calls of each per round")
    p.add_argument("--overhead-length", type=int, default=4096)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=2, help="(b) timed calls per configuration")
    p.add_argument("--lsh-method", default="lsh", help="(b) flash_attn_func's method of the LSH rows")
    p.add_argument("--samples", type=int, default=16, help="LSH hashes per head")
    p.add_argument("--memory-limit-gib", type=float, default=16.0)
    p.add_argument("--headroom-gib", type=float, default=4.0)
    p.add_argument("--dense-repeats", type=int, default=1, help="(b) timed calls of dense PyTorch (no warm-up)")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--child-impl", help=argparse.SUPPRESS)
    p.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-mode", choices=("fwd", "fwd_bwd"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child_impl:
        return child(args)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    def log(text):
        print(text, file=sys.stderr, flush=True)

    over = run_overhead(args) if args.part in ("overhead", "all") else None
    if over:
        log(json.dumps(over))
    rows = dense_comparison(args, log) if args.part in ("dense", "all") else []
    text = markdown(args, over, rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(overhead=over, rows=rows, argv=sys.argv[1:]), handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
