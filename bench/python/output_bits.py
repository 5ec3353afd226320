#!/usr/bin/env python3
"""Bit-for-bit comparison of two builds of the Python module on a fixed grid of calls.

    python3 bench/python/output_bits.py --old OLD_BUILD/python --new NEW_BUILD/python

runs the grid once with each build on PYTHONPATH (a child process each) and lists every output
whose bytes differ. The grid covers every method of the all-heads calls in float32, bfloat16 and
float16 (float64 for the exact methods), causal and bidirectional, through FlashAttention's
calls (forward, softmax_lse, varlen packed batches, KV caches contiguous and paged, one-token
decode and chunked prefill, sequences with more queries than keys) and through ``poslsh.torch.multihead_attention`` (forward and the
gradients of q, k, v by autograd, grouped-query heads included). Inputs come from a fixed seed,
so both builds see the same bytes. Exits 1 if any output differs.

    python3 bench/python/output_bits.py --save FILE.npz     # the grid of the build on PYTHONPATH
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

METHODS = ("exact_tiled", "exact_banded", "lsh_fused", "lsh_per_sample", "fixed_blocks", "mean_of_outputs")
# FlashAttention's method names (flash_attn_* take poslsh's too).
FLASH_METHODS = ("exact", "banded", "lsh", "lsh_per_sample", "fixed_blocks", "mean_of_outputs")


def grid():
    """(name, tensors) of every call of the grid, computed with the build on sys.path."""
    import torch
    import poslsh.torch as pt

    torch.manual_seed(20261205)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "float64": torch.float64}
    results = []

    def record(name, *tensors):
        results.append((name, [t.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()
                               if t.dtype in (torch.bfloat16, torch.float16)
                               else t.detach().contiguous().numpy().copy() for t in tensors]))

    def attempt(name, call):
        try:
            record(name, *call())
        except (ValueError, TypeError) as error:  # a refused combination is an output too (its type)
            results.append((name, [np.frombuffer(type(error).__name__.encode(), dtype=np.uint8)]))

    batch, heads, kv_heads, d = 2, 4, 2, 32
    slopes = pt.make_alibi_slopes(heads)
    for dtype_name, dtype in dtypes.items():
        methods = FLASH_METHODS if dtype_name != "float64" else ("exact", "banded")
        for causal in (True, False):
            for seqlen_q, seqlen_k in ((200, 200), (37, 200), (200, 37)):
                q = torch.randn(batch, seqlen_q, heads, d).to(dtype)
                k = torch.randn(batch, seqlen_k, kv_heads, d).to(dtype)
                v = torch.randn(batch, seqlen_k, kv_heads, d).to(dtype)
                for method in methods:
                    tag = f"flash/{dtype_name}/causal={causal}/{seqlen_q}x{seqlen_k}/{method}"
                    attempt(tag, lambda: [pt.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                                             method=method)])
                    attempt(tag + "/lse", lambda: pt.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                                                     method=method, return_attn_probs=True)[:2])
                    if method in ("exact", "banded"):
                        attempt(tag + "/window", lambda: pt.flash_attn_func(
                            q, k, v, causal=causal, alibi_slopes=slopes, method=method, window_size=(48, 16),
                            return_attn_probs=True)[:2])
            # varlen: three sequences of different lengths, one empty
            cu = torch.tensor([0, 90, 90, 217], dtype=torch.int32)
            q = torch.randn(217, heads, d).to(dtype)
            k = torch.randn(217, kv_heads, d).to(dtype)
            v = torch.randn(217, kv_heads, d).to(dtype)
            for method in methods:
                attempt(f"varlen/{dtype_name}/causal={causal}/{method}", lambda: [pt.flash_attn_varlen_func(
                    q, k, v, cu, cu, 127, 127, causal=causal, alibi_slopes=slopes, method=method)])
                attempt(f"varlen/{dtype_name}/causal={causal}/{method}/lse", lambda: pt.flash_attn_varlen_func(
                    q, k, v, cu, cu, 127, 127, causal=causal, alibi_slopes=slopes, method=method,
                    return_attn_probs=True)[:2])
            # varlen with more queries than keys in a sequence (rows before its first key)
            cu_k = torch.tensor([0, 40, 60, 260], dtype=torch.int32)
            k_long = torch.randn(260, kv_heads, d).to(dtype)
            v_long = torch.randn(260, kv_heads, d).to(dtype)
            for method in methods:
                attempt(f"varlen_rows_before_keys/{dtype_name}/causal={causal}/{method}/lse",
                        lambda: pt.flash_attn_varlen_func(q, k_long, v_long, cu, cu_k, 127, 200, causal=causal,
                                                          alibi_slopes=slopes, method=method,
                                                          return_attn_probs=True)[:2])
        # KV caches: prefill in two chunks, then one-token decode steps, contiguous and paged.
        if dtype_name == "float64":
            continue
        for paged in (False, True):
            for method in methods:
                length, block = 300, 64
                k_all = torch.randn(batch, length, kv_heads, d).to(dtype)
                v_all = torch.randn(batch, length, kv_heads, d).to(dtype)
                q_all = torch.randn(batch, length, heads, d).to(dtype)
                blocks = (length + block - 1) // block
                if paged:
                    k_cache = torch.zeros(batch * blocks, block, kv_heads, d, dtype=dtype)
                    v_cache = torch.zeros_like(k_cache)
                    table = torch.arange(batch * blocks, dtype=torch.int32).flip(0).reshape(batch, blocks)
                else:
                    k_cache = torch.zeros(batch, length, kv_heads, d, dtype=dtype)
                    v_cache = torch.zeros_like(k_cache)
                    table = None
                position = 0
                outputs = []
                for step in (150, 100, 1, 1, 1):
                    lengths = torch.full((batch,), position, dtype=torch.int32)
                    rows = slice(position, position + step)
                    try:
                        out, lse = pt.flash_attn_with_kvcache(
                            q_all[:, rows], k_cache, v_cache, k_all[:, rows], v_all[:, rows], cache_seqlens=lengths,
                            block_table=table, causal=True, alibi_slopes=slopes, method=method,
                            return_softmax_lse=True)
                        outputs += [out, lse]
                    except (ValueError, TypeError) as error:
                        outputs.append(torch.frombuffer(bytearray(type(error).__name__.encode()), dtype=torch.uint8))
                        break
                    position += step
                record(f"kvcache/{dtype_name}/paged={paged}/{method}", *outputs)
                # more queries than cached tokens (rows before the first key), no append
                for causal in (True, False):
                    lengths = torch.tensor([25, 3], dtype=torch.int32)
                    attempt(f"kvcache_rows_before_keys/{dtype_name}/paged={paged}/causal={causal}/{method}",
                            lambda: pt.flash_attn_with_kvcache(
                                q_all[:, :40], k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                causal=causal, alibi_slopes=slopes, method=method, return_softmax_lse=True))
    # Training: poslsh.torch.multihead_attention, forward and gradients by autograd.
    for dtype_name in ("float32", "bfloat16", "float16", "float64"):
        dtype = dtypes[dtype_name]
        for method in METHODS:
            for masking in ("causal", "bidirectional"):
                n = 160
                q = torch.randn(n, heads, d).to(dtype).requires_grad_()
                k = torch.randn(n, kv_heads, d).to(dtype).requires_grad_()
                v = torch.randn(n, kv_heads, d).to(dtype).requires_grad_()
                dout = torch.randn(n, heads, d).to(dtype)

                def train():
                    out = pt.multihead_attention(q, k, v, method=method, masking=masking, samples=8, seed=3)
                    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
                    return out, dq, dk, dv

                attempt(f"train/{dtype_name}/{masking}/{method}", train)
    # Training through flash_attn_func: gradients of q, k, v and (exact methods) the slopes.
    for dtype_name in ("float32", "bfloat16", "float64"):
        dtype = dtypes[dtype_name]
        for method in FLASH_METHODS if dtype_name != "float64" else ("exact", "banded"):
            q = torch.randn(batch, 120, heads, d).to(dtype).requires_grad_()
            k = torch.randn(batch, 120, kv_heads, d).to(dtype).requires_grad_()
            v = torch.randn(batch, 120, kv_heads, d).to(dtype).requires_grad_()
            trainable = slopes.clone().requires_grad_(method in ("exact", "banded"))
            dout = torch.randn(batch, 120, heads, d).to(dtype)

            def flash_train():
                out = pt.flash_attn_func(q, k, v, causal=True, alibi_slopes=trainable, method=method)
                inputs = (q, k, v, trainable) if trainable.requires_grad else (q, k, v)
                return (out, *torch.autograd.grad(out, inputs, dout))

            attempt(f"flash_train/{dtype_name}/{method}", flash_train)
            k_short, v_short = (x[:, :50].detach().clone().requires_grad_() for x in (k, v))

            def flash_train_rows_before_keys():  # 120 queries over 50 keys, not causal
                out = pt.flash_attn_func(q, k_short, v_short, alibi_slopes=trainable, method=method)
                inputs = (q, k_short, v_short, trainable) if trainable.requires_grad else (q, k_short, v_short)
                return (out, *torch.autograd.grad(out, inputs, dout))

            attempt(f"flash_train_rows_before_keys/{dtype_name}/{method}", flash_train_rows_before_keys)
    return results


def save(path):
    results = grid()
    np.savez(path, **{f"{i:04d}|{name}|{j}": array for i, (name, arrays) in enumerate(results)
                      for j, array in enumerate(arrays)})
    print(f"output_bits: {len(results)} calls saved to {path}")


def load(path):
    data = np.load(path)
    calls = {}
    for key in data.files:
        _, name, j = key.split("|")
        calls.setdefault(name, {})[int(j)] = data[key]
    return calls


def compare(old_path, new_path):
    old, new = load(old_path), load(new_path)
    differences = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"only in {'new' if name not in old else 'old'}: {name}")
            differences += 1
            continue
        a, b = old[name], new[name]
        same = a.keys() == b.keys() and all(a[j].dtype == b[j].dtype and a[j].shape == b[j].shape
                                             and a[j].tobytes() == b[j].tobytes() for j in a)
        if not same:
            differences += 1
            detail = ""
            if a.keys() == b.keys():
                for j in sorted(a):
                    if a[j].shape == b[j].shape and a[j].dtype == b[j].dtype and a[j].dtype.kind == "f":
                        diff = np.abs(a[j].astype(np.float64) - b[j].astype(np.float64))
                        detail += f" [output {j}: max |diff| {np.nanmax(diff):.3g}]"
                    elif a[j].dtype.kind == "u" and a[j].ndim == 1 and a[j].size < 2000:
                        detail += (f" [output {j}: '{bytes(a[j]).decode(errors='replace')[:120]}' vs "
                                   f"'{bytes(b[j]).decode(errors='replace')[:120]}']")
            print(f"differs: {name}{detail}")
    print(f"output_bits: {len(set(old) | set(new))} calls compared, {differences} differ")
    return 1 if differences else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", help="run the grid with the build on PYTHONPATH and save it here")
    parser.add_argument("--old", help="the old build's python folder (holding poslsh/)")
    parser.add_argument("--new", help="the new build's python folder")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the runs (default 2)")
    args = parser.parse_args()
    if args.save:
        save(args.save)
        return 0
    if not (args.old and args.new):
        parser.error("give --save, or both --old and --new")
    work = tempfile.mkdtemp()
    paths = []
    for label, folder in (("old", args.old), ("new", args.new)):
        path = os.path.join(work, f"{label}.npz")
        environment = dict(os.environ, PYTHONPATH=os.path.abspath(folder), OMP_NUM_THREADS=str(args.threads))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--save", path], check=True, env=environment)
        paths.append(path)
    return compare(*paths)


if __name__ == "__main__":
    sys.exit(main())
