"""Fixed cost of small poslsh.torch calls (1 thread, the minimum over 200 calls after 10 untimed):
the time the Python side and the dispatcher add around small kernels.

    python3 bench/python/call_cost_bench.py PACKAGE_DIR

PACKAGE_DIR is put first on sys.path (the directory holding poslsh/, e.g. python or
build-py/python). To compare with an earlier commit REV, unpack its package beside the compiled
module and run both:

    mkdir -p /tmp/old && git archive REV python/poslsh | tar -x -C /tmp/old
    cp python/poslsh/_core*.so /tmp/old/python/poslsh/
    python3 bench/python/call_cost_bench.py /tmp/old/python; python3 bench/python/call_cost_bench.py python
"""

import sys
import time


def best(call, n=200):
    for _ in range(10):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main():
    sys.path.insert(0, sys.argv[1])
    import torch
    import poslsh.torch as pt

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 64, generator=g)
    k_cache = torch.randn(1, 256, 8, 64, generator=g)
    v_cache = k_cache.clone()
    lengths = torch.tensor([200], dtype=torch.int32)
    slopes = pt.make_alibi_slopes(8)
    new = torch.randn(1, 1, 8, 64, generator=g)
    x = torch.randn(1, 64, 8, 64, generator=g)
    a = torch.randn(64, 64, generator=g)
    rows = {}
    with torch.no_grad():
        rows["flash_attn_with_kvcache decode step (L = 200, 8 heads, d = 64)"] = best(
            lambda: pt.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, cache_seqlens=lengths, causal=True,
                                               alibi_slopes=slopes))
        rows["flash_attn_func forward (64 tokens, 8 heads, d = 64)"] = best(
            lambda: pt.flash_attn_func(x, x, x, causal=True, alibi_slopes=slopes))
        rows["alibi_attention forward (64 x 64)"] = best(lambda: pt.alibi_attention(a, a, a, 4.0))
        rows["alibi_attention_forward (64 x 64)"] = best(lambda: pt.alibi_attention_forward(a, a, a, 4.0))
    leaf = x.clone().requires_grad_()
    rows["flash_attn_func forward + backward (64 tokens)"] = best(
        lambda: pt.flash_attn_func(leaf, leaf, leaf, causal=True, alibi_slopes=slopes).sum().backward(), 100)
    leaf_a = a.clone().requires_grad_()
    rows["alibi_attention forward + backward (64 x 64)"] = best(
        lambda: pt.alibi_attention(leaf_a, leaf_a, leaf_a, 4.0).sum().backward(), 100)
    print(f"package {sys.argv[1]}, torch {torch.__version__}, 1 thread")
    for name, micros in rows.items():
        print(f"{name}: {micros:.1f} us")


if __name__ == "__main__":
    main()
