"""Decode-step cost of poslsh.torch.flash_attn_with_kvcache and the fixed cost of flash_attn_func:
the current python/poslsh/flash.py against the one of an earlier commit, in one process.

    PYTHONPATH=build-py/python python3 bench/python/decode_torch_bench.py [--old-rev REV] [--rounds 15]
        [--lengths 4096 16384] [--markdown FILE]
    PYTHONPATH=build-py/python python3 bench/python/decode_torch_bench.py --paged [--old-rev REV]
        [--rounds 5] [--lengths 16384] [--batch 4] [--heads 32] [--headdim 128] [--page 256]

The earlier flash.py is read with `git show REV:python/poslsh/flash.py` and loaded as a separate
module whose operators are registered under the namespace poslsh_old (the compiled kernels are
the same poslsh._core), so both run on one machine state. Each round times the old and the new
call (which one goes first alternates from round to round), max(5, 40960 // L) calls each for a
decode step over L keys and 200 for flash_attn_func, after one untimed call. The table gives the
median over the rounds of the time per call and the median of the rounds' old / new ratios; a
direct-call row is timed after the pair in each round, its old and new columns both its median.
Every case also checks that the two outputs (and softmax_lse) are bitwise equal, and the new
output bitwise the direct call's. The page-fault column is the process's minor page faults
(getrusage) per call over 3 further calls: memory touched for the first time, e.g. a fresh
copy of the keys.

Cases (batch 1, seqlen_q 1, 8 query heads, 8 K/V heads, head dim 64, causal, the official ALiBi
slopes, method "exact"):
- one decode step of flash_attn_with_kvcache: the new token's k, v appended at cache_seqlens =
  L - 1 of a contiguous (1, L, 8, 64) cache, then attention over its L keys; float32 q and cache,
  and bfloat16 q and cache; also both with return_softmax_lse (a bfloat16 cache: the outputs compared,
  not the lse); and (float32) the direct
  poslsh._core.multihead_attention call on the cache row for the kernel's own time;
- flash_attn_func at seqlen 16 (q, k, v (1, 16, 8, 64) float32), and the direct
  poslsh._core.multihead_attention call on the same tensors for the kernel's own time.

--paged runs the paged decode cases instead: one decode step of flash_attn_with_kvcache over a
paged cache (num_blocks, page, heads, headdim) in shuffled page order with an int32 block table,
batch sequences of L tokens after the append (cache_seqlens = L - 1, one new token each), q
(batch, 1, heads, headdim), the official ALiBi slopes of `heads` heads, causal, method "exact";
float32 and bfloat16 (q and cache of one dtype), with and without return_softmax_lse. Besides the
times and the page faults, the table gives the peak memory of one call: the increase of the
process's peak resident set (VmHWM, reset through /proc/self/clear_refs just before the call,
minus VmRSS then), which counts every byte the call touches for the first time, the copies of the
keys included; and the bytes of the cache a call copies (a gathered path copies K and V of every
used token: 2 batch L heads headdim itemsize).
"""

import argparse
import gc
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import poslsh.torch as ptorch
from poslsh import _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADS, HEADDIM = 8, 64


def load_old(rev):
    """flash.py of commit `rev` as a module registering its operators under poslsh_old."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:python/poslsh/flash.py"], check=True,
                            capture_output=True, text=True).stdout
    source = source.replace("from . import _core", "from poslsh import _core")
    source = source.replace('torch.library.Library("poslsh", "DEF")', 'torch.library.Library("poslsh_old", "DEF")')
    source = source.replace('f"poslsh::{name}"', 'f"poslsh_old::{name}"')  # custom ops (torch.library.custom_op)
    source = source.replace("torch.ops.poslsh.", "torch.ops.poslsh_old.")
    source = source.replace("getattr(torch.ops.poslsh, ", "getattr(torch.ops.poslsh_old, ")
    path = os.path.join(tempfile.mkdtemp(), "poslsh_flash_old.py")
    with open(path, "w") as handle:
        handle.write(source)
    spec = importlib.util.spec_from_file_location("poslsh_flash_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slopes():
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)])


def decode_case(length, dtype, with_lse):
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(1, 1, HEADS, HEADDIM, generator=generator).to(dtype)
    k_cache = torch.randn(1, length, HEADS, HEADDIM, generator=generator).to(dtype)
    v_cache = torch.randn(1, length, HEADS, HEADDIM, generator=generator).to(dtype)
    k_new = torch.randn(1, 1, HEADS, HEADDIM, generator=generator).to(dtype)
    v_new = torch.randn(1, 1, HEADS, HEADDIM, generator=generator).to(dtype)
    seqlens = torch.tensor([length - 1], dtype=torch.int32)
    alibi = slopes()

    def call(module):
        return lambda: module.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                      causal=True, alibi_slopes=alibi,
                                                      return_softmax_lse=with_lse)
    sigmas = [1.0 / s for s in alibi.tolist()]

    def direct():  # the kernel alone on the cache (float32 only)
        out = torch.empty(1, HEADS, HEADDIM)
        _core.multihead_attention(q[0].numpy(), k_cache[0].numpy(), v_cache[0].numpy(), layout="nhd",
                                  method="exact_tiled", masking="causal", sigmas=sigmas, query_offset=length - 1,
                                  out=out.numpy())
        return out[None]
    return call, direct


def func_case(seqlen):
    generator = torch.Generator().manual_seed(seqlen)
    q, k, v = (torch.randn(1, seqlen, HEADS, HEADDIM, generator=generator) for _ in range(3))
    alibi = slopes()

    def call(module):
        return lambda: module.flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi)
    sigmas = [1.0 / s for s in alibi.tolist()]

    def direct():
        out = torch.empty(seqlen, HEADS, HEADDIM)
        _core.multihead_attention(q[0].numpy(), k[0].numpy(), v[0].numpy(), layout="nhd", method="exact_tiled",
                                  masking="causal", sigmas=sigmas, out=out.numpy())
        return out[None]
    return call, direct


def paged_case(length, dtype, with_lse, batch, heads, headdim, page):
    """A decode step over a paged cache: see the file comment (--paged)."""
    generator = torch.Generator().manual_seed(length + batch)
    blocks = (length + page - 1) // page
    num_blocks = batch * blocks + 1  # one block no sequence uses
    shape = (num_blocks, page, heads, headdim)
    k_pages = torch.randn(shape, generator=generator).to(dtype)
    v_pages = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)[:batch * blocks]
    table = order.reshape(batch, blocks).to(torch.int32)
    q = torch.randn(batch, 1, heads, headdim, generator=generator).to(dtype)
    k_new = torch.randn(batch, 1, heads, headdim, generator=generator).to(dtype)
    v_new = torch.randn(batch, 1, heads, headdim, generator=generator).to(dtype)
    seqlens = torch.full((batch,), length - 1, dtype=torch.int32)
    alibi = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])

    def call(module):
        return lambda: module.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                                                      block_table=table, causal=True, alibi_slopes=alibi,
                                                      return_softmax_lse=with_lse)
    copied = 2 * batch * length * heads * headdim * k_pages.element_size()
    return call, copied


def _status(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_bytes(function):
    """The increase of the process's peak resident set during one call of `function` (bytes):
    VmHWM after the call, reset to VmRSS just before it (/proc/self/clear_refs), minus VmRSS."""
    function()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = _status("VmRSS")
    function()
    return _status("VmHWM") - before


def per_call(function, calls):
    function()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls


def faults_per_call(function, calls=3):
    """Minor page faults of the process per call (fresh memory being touched)."""
    function()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        function()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def same(a, b):
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def compare(old, new, rounds, calls, direct=None):
    """Median seconds per call of old and new, the median of the rounds' old / new ratios, and
    the median seconds per call of `direct` (timed after the pair in each round; None if not
    given)."""
    old_times, new_times, ratios, direct_times = [], [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            t_old, t_new = per_call(old, calls), per_call(new, calls)
        else:
            t_new, t_old = per_call(new, calls), per_call(old, calls)
        old_times.append(t_old)
        new_times.append(t_new)
        ratios.append(t_old / t_new)
        if direct is not None:
            direct_times.append(per_call(direct, calls))
    t_direct = statistics.median(direct_times) if direct is not None else None
    return statistics.median(old_times), statistics.median(new_times), statistics.median(ratios), t_direct


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old-rev", default="a33f5ce", help="commit whose flash.py is the old implementation")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--paged", action="store_true", help="the paged decode cases (file comment)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--page", type=int, default=256)
    args = parser.parse_args()
    old = load_old(args.old_rev)
    if args.paged:
        return paged_main(args, old)
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            for dtype, with_lse in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                    (torch.bfloat16, True)):
                call, direct = decode_case(length, dtype, with_lse)
                old_call, new_call = call(old), call(ptorch)
                # A bfloat16 cache's softmax_lse may be an earlier revision's float32 computation
                # beside the matrix unit's output: only the outputs are compared there.
                equal = same(old_call()[0], new_call()[0]) if dtype != torch.float32 and with_lse else \
                    same(old_call(), new_call())
                plain = dtype == torch.float32 and not with_lse
                if plain:
                    equal = equal and torch.equal(new_call(), direct())
                calls = max(5, 40960 // length)
                t_old, t_new, ratio, t_direct = compare(old_call, new_call, args.rounds, calls,
                                                        direct if plain else None)
                faults = f"{faults_per_call(old_call):.0f} / {faults_per_call(new_call):.0f}"
                name = f"flash_attn_with_kvcache, L = {length}, {str(dtype).replace('torch.', '')} cache"
                if with_lse:
                    name += ", return_softmax_lse"
                rows.append((name, t_old, t_new, ratio, equal, faults))
                print(rows[-1], flush=True)
                if plain:
                    rows.append((f"_core.multihead_attention on the cache, L = {length} (direct)", t_direct,
                                 t_direct, 1.0, equal, f"{faults_per_call(direct):.0f}"))
        call, direct = func_case(16)
        old_call, new_call = call(old), call(ptorch)
        equal = same(old_call(), new_call()) and same(new_call(), direct())
        t_old, t_new, ratio, t_direct = compare(old_call, new_call, args.rounds, 200, direct)
        faults = f"{faults_per_call(old_call):.0f} / {faults_per_call(new_call):.0f}"
        rows.append(("flash_attn_func, seqlen 16", t_old, t_new, ratio, equal, faults))
        print(rows[-1], flush=True)
        rows.append(("_core.multihead_attention, seqlen 16 (direct)", t_direct, t_direct, 1.0, equal,
                     f"{faults_per_call(direct):.0f}"))
    lines = [f"torch.get_num_threads() = {torch.get_num_threads()}, old = {args.old_rev}, {args.rounds} rounds", "",
             "| call | old (us) | new (us) | old / new (median of rounds) | page faults per call (old / new) | "
             "bitwise equal |", "|---|---|---|---|---|---|"]
    for name, t_old, t_new, ratio, equal, faults in rows:
        lines.append(f"| {name} | {t_old * 1e6:.0f} | {t_new * 1e6:.0f} | {ratio:.2f} | {faults} | "
                     f"{'yes' if equal else 'NO'} |")
    return write_table(lines, args.markdown, all(row[4] for row in rows))


def write_table(lines, markdown, equal):
    """Prints the table (and writes it to the file `markdown`); the exit status: 0 if every row was
    bitwise equal."""
    table = "\n".join(lines)
    print(table)
    if markdown:
        with open(markdown, "w") as handle:
            handle.write(table + "\n")
    return 0 if equal else 1


def paged_main(args, old):
    """The --paged table: time per call, page faults, peak memory and bytes of the cache copied."""
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            for dtype in (torch.float32, torch.bfloat16):
                for with_lse in (False, True):
                    call, copied = paged_case(length, dtype, with_lse, args.batch, args.heads, args.headdim,
                                              args.page)
                    old_call, new_call = call(old), call(ptorch)
                    equal = same(old_call(), new_call())
                    calls = max(2, 8192 // length)
                    t_old, t_new, ratio, _ = compare(old_call, new_call, args.rounds, calls)
                    faults = f"{faults_per_call(old_call):.0f} / {faults_per_call(new_call):.0f}"
                    peak = f"{peak_bytes(old_call) / 2**20:.0f} / {peak_bytes(new_call) / 2**20:.0f}"
                    name = (f"paged decode, L = {length}, {str(dtype).replace('torch.', '')}"
                            + (", return_softmax_lse" if with_lse else ""))
                    rows.append((name, t_old, t_new, ratio, faults, peak, f"{copied / 2**20:.0f} / 0", equal))
                    print(rows[-1], flush=True)
                    del call, old_call, new_call
                    gc.collect()
    lines = [f"torch.get_num_threads() = {torch.get_num_threads()}, old = {args.old_rev}, {args.rounds} rounds, "
             f"batch {args.batch}, {args.heads} heads (K/V too), head dim {args.headdim}, page {args.page}", "",
             "| call | old (ms) | new (ms) | old / new (median of rounds) | page faults per call (old / new) | "
             "peak memory of a call, MiB (old / new) | cache bytes copied, MiB (old / new) | bitwise equal |",
             "|---|---|---|---|---|---|---|---|"]
    for name, t_old, t_new, ratio, faults, peak, copied, equal in rows:
        lines.append(f"| {name} | {t_old * 1e3:.0f} | {t_new * 1e3:.0f} | {ratio:.2f} | {faults} | {peak} | {copied} | "
                     f"{'yes' if equal else 'NO'} |")
    return write_table(lines, args.markdown, all(row[-1] for row in rows))


if __name__ == "__main__":
    sys.exit(main())
