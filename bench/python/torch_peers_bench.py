#!/usr/bin/env python3
"""poslsh's ALiBi attention beside PyTorch's own kernels on the CPU.

    python bench/python/torch_peers_bench.py [--lengths 4096 16384] [--dtypes float32 bfloat16]
                                             [--repeats 3] [--quick] [--markdown out.md]

(poslsh imported from the environment: installed with `pip install .`, or PYTHONPATH=build-py/python.)

Rows, at batch 1, 8 heads, head dim 64, causal ALiBi with the official slopes m_h = 2^-(h+1),
h = 0..7, softmax scale 1/sqrt(64):

    out_i = softmax_j(q_i . k_j / 8 - m_h (i - j)) v_j   over j <= i

- poslsh exact: ``poslsh.torch.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)``
  (method "exact"), q, k, v of shape (1, n, 8, 64).
- poslsh LSH: the same call with method="lsh_fused" (16 hashes per head): an estimate, not the
  exact formula; its relative error against poslsh exact at the check length is printed.
- torch SDPA: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)``,
  q, k, v of shape (1, 8, n, 64), with the dense ALiBi mask bias[0, h, i, j] = -m_h (i - j) for
  j <= i and -inf above the diagonal, of shape (1, 8, n, n) in the inputs' dtype (what a model
  without a fused ALiBi kernel passes; 4 n^2 H bytes in float32).
- torch FlexAttention: ``torch.compile(flex_attention)(q, k, v, score_mod=alibi,
  block_mask=causal)``, q, k, v of shape (1, 8, n, 64), score_mod(score, b, h, i, j) =
  score - m_h (i - j), the block mask of j <= i from ``create_block_mask`` (so masked blocks
  are skipped).

The masks, block masks and the compiled function are built once outside the timed region. The
first call of each cell (compiling FlexAttention) is the warm-up; the time is the minimum over
--repeats calls after it. "forward" runs under torch.no_grad(); "forward + backward" times the
call and ``out.backward(g)`` for a fixed random g, with gradients for q, k and v (not the
slopes: neither peer differentiates its bias). FlexAttention has no backward on the CPU
(NotImplementedError), reported as "unsupported".

Every cell runs in a child process with torch.set_num_threads(--threads) and
OMP_NUM_THREADS=--threads (poslsh's kernels), default 2, under an address-space limit
(RLIMIT_AS, --memory-limit-gib, default 20): an allocation beyond it fails inside the child and
the cell reads "OOM" instead of exhausting the machine. A cell whose estimated memory exceeds the
machine's available memory (MemAvailable) is not started ("not run").

Before any timing, a check at n = --check-length (default 512) in float32 and bfloat16 asserts
that every exact row computes the formula above: poslsh exact against a dense float64 evaluation
written here, and each peer's output (and, where the peer has a backward, its dq, dk, dv)
against poslsh exact's (float32: max abs difference <= 1e-4; bfloat16: <= 3e-2).
The table gives seconds and the ratio time / time of poslsh exact in the same row group (for
the peers: how many times slower than poslsh exact).
"""

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

HEADS, HEAD_DIM, BATCH = 8, 64, 1
GIB = 1024 ** 3
IMPLEMENTATIONS = ("poslsh_exact", "poslsh_lsh", "sdpa", "flex")
LABELS = {
    "poslsh_exact": "poslsh exact",
    "poslsh_lsh": "poslsh LSH (lsh_fused, 16 hashes)",
    "sdpa": "torch SDPA + dense ALiBi mask",
    "flex": "torch FlexAttention (compiled, ALiBi score_mod)",
}
PASSES = ("forward", "forward+backward")
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def slopes_list():
    """The official ALiBi slopes of 8 heads: 2^-1 .. 2^-8."""
    return [2.0 ** -(h + 1) for h in range(HEADS)]


def item_bytes(dtype):
    return 4 if dtype == "float32" else 2


def estimate_bytes(impl, n, dtype, backward):
    """Memory a cell needs beyond torch itself: the inputs, outputs and gradients, plus SDPA's
    dense mask (H n^2 elements); poslsh and FlexAttention keep O(n) per head."""
    tensors = (3 + 1 + (4 if backward else 0)) * BATCH * n * HEADS * HEAD_DIM * item_bytes(dtype)
    if impl == "sdpa":
        tensors += HEADS * n * n * item_bytes(dtype) + n * n * 9  # the mask; building it, per head
    return tensors + 2 * GIB  # torch, the compiled code, the allocator's slack


def available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


# ----------------------------------------------------------------------------------------------
# The implementations (in the child processes)


def torch_dtype(torch, name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]


def make_runner(torch, impl, n, dtype):
    """Returns (layout, call): layout "nhd" ((1, n, 8, 64), poslsh's and FlashAttention's) or
    "hnd" ((1, 8, n, 64), PyTorch's); call(q, k, v) -> out in that layout. Everything the call
    needs besides q, k, v (masks, compiled functions) is built here, outside the timing."""
    slopes = torch.tensor(slopes_list(), dtype=torch.float32)
    if impl in ("poslsh_exact", "poslsh_lsh"):
        import poslsh.torch as ptorch

        method = "exact" if impl == "poslsh_exact" else "lsh_fused"

        def call(q, k, v):
            return ptorch.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method)

        return "nhd", call
    if impl == "sdpa":
        positions = torch.arange(n, dtype=torch.float32)
        distance = positions[:, None] - positions[None, :]  # i - j
        above = distance < 0
        bias = torch.empty((1, HEADS, n, n), dtype=torch_dtype(torch, dtype))
        for h, slope in enumerate(slopes_list()):  # one head at a time: n^2 temporaries only
            bias[0, h].copy_((distance * -slope).masked_fill_(above, float("-inf")))
        del distance, above
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def call(q, k, v):
            return sdpa(q, k, v, attn_mask=bias)

        return "hnd", call
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(causal, None, None, n, n, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)

        def call(q, k, v):
            return compiled(q, k, v, score_mod=alibi, block_mask=block_mask)

        return "hnd", call
    raise ValueError(f"torch_peers_bench: unknown implementation {impl!r}")


def random_inputs(torch, n, dtype, seed=0):
    """q, k, v, g of shape (1, n, 8, 64) (nhd), standard normal, rounded to dtype."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, n, HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=generator).to(torch_dtype(torch, dtype)) for _ in range(4)]


def to_layout(x, layout):
    """(1, n, H, d) -> the implementation's layout (a contiguous copy for hnd)."""
    return x if layout == "nhd" else x.transpose(1, 2).contiguous()


def from_layout(x, layout):
    return x if layout == "nhd" else x.transpose(1, 2)


def run_pass(torch, call, layout, q, k, v, g, backward):
    """One call (forward, or forward + backward); returns (out, grads or None) in nhd layout."""
    if not backward:
        with torch.no_grad():
            return from_layout(call(q, k, v), layout), None
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = call(*leaves)
    out.backward(to_layout(g, layout))
    return from_layout(out.detach(), layout), [from_layout(x.grad, layout) for x in leaves]


# ----------------------------------------------------------------------------------------------
# Child: the check


def dense_reference(torch, q, k, v):
    """The formula of the module docstring in float64, dense, for (1, n, H, d) inputs."""
    q, k, v = (x.double().transpose(1, 2)[0] for x in (q, k, v))  # (H, n, d)
    n = q.shape[1]
    positions = torch.arange(n, dtype=torch.float64)
    distance = positions[:, None] - positions[None, :]
    slopes = torch.tensor(slopes_list(), dtype=torch.float64)
    scores = q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM) - slopes[:, None, None] * distance
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).unsqueeze(0)  # (1, n, H, d)


def check(torch, n, dtypes, impls):
    """Asserts the exact rows compute the same thing (module docstring); returns a report."""
    report = []
    for dtype in dtypes:
        q, k, v, g = random_inputs(torch, n, dtype, seed=1)
        layout, call = make_runner(torch, "poslsh_exact", n, dtype)
        ref_out, ref_grads = run_pass(torch, call, layout, q, k, v, g, backward=True)
        dense = dense_reference(torch, q, k, v)
        err = (ref_out.double() - dense).abs().max().item()
        assert err <= TOLERANCE[dtype], f"poslsh exact {dtype}: max |out - dense float64| = {err}"
        report.append(f"{dtype}: poslsh exact vs dense float64 formula: max abs diff {err:.2e}")
        for impl in impls:
            if impl == "poslsh_exact":
                continue
            layout, call = make_runner(torch, impl, n, dtype)
            inputs = [to_layout(x, layout) for x in (q, k, v)]
            if impl == "poslsh_lsh":
                out, _ = run_pass(torch, call, layout, *inputs, g, backward=False)
                rel = ((out.double() - ref_out.double()).norm() / ref_out.double().norm()).item()
                report.append(f"{dtype}: poslsh LSH (an estimate) vs poslsh exact: relative error {rel:.3f}")
                continue
            out, _ = run_pass(torch, call, layout, *inputs, g, backward=False)
            diff = (out.double() - ref_out.double()).abs().max().item()
            assert diff <= TOLERANCE[dtype], f"{impl} {dtype}: max |out - poslsh exact| = {diff}"
            line = f"{dtype}: {LABELS[impl]} vs poslsh exact: out max abs diff {diff:.2e}"
            try:
                _, grads = run_pass(torch, call, layout, *inputs, g, backward=True)
            except NotImplementedError as error:
                line += f"; backward unsupported ({str(error).splitlines()[0][:80]})"
            else:
                for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
                    scale = max(1.0, b.double().abs().max().item())
                    gdiff = (a.double() - b.double()).abs().max().item() / scale
                    assert gdiff <= TOLERANCE[dtype] * 2, f"{impl} {dtype}: {name} max diff / max |{name}| = {gdiff}"
                    line += f", {name} {gdiff:.2e}"
            report.append(line)
    return report


# ----------------------------------------------------------------------------------------------
# Child: one timed cell


def time_cell(torch, impl, n, dtype, backward, repeats):
    q, k, v, g = random_inputs(torch, n, dtype)
    layout, call = make_runner(torch, impl, n, dtype)
    q, k, v = (to_layout(x, layout) for x in (q, k, v))  # g: run_pass converts it
    start = time.perf_counter()
    run_pass(torch, call, layout, q, k, v, g, backward)  # warm-up (compiles FlexAttention)
    warmup = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_pass(torch, call, layout, q, k, v, g, backward)
        times.append(time.perf_counter() - start)
    return {"status": "ok", "seconds": min(times), "times": times, "warmup": warmup}


def child_main(args):
    import torch

    torch.set_num_threads(args.threads)
    try:
        if args.child == "check":
            result = {"status": "ok", "report": check(torch, args.check_length, args.dtypes, args.impls)}
        else:
            impl, n, dtype, pass_name = args.child.split(":")
            try:
                result = time_cell(torch, impl, int(n), dtype, pass_name == "forward+backward", args.repeats)
            except NotImplementedError as error:
                result = {"status": "unsupported", "detail": str(error).splitlines()[0][:160]}
            except (MemoryError, RuntimeError) as error:
                text = str(error)
                if isinstance(error, MemoryError) or "alloc" in text.lower() or "memory" in text.lower():
                    result = {"status": "OOM", "detail": text.splitlines()[0][:160] if text else "MemoryError"}
                else:
                    raise
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    except AssertionError as error:
        result = {"status": "check failed", "detail": str(error)}
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# Parent


def run_child(args, what, timeout):
    limit = int(args.memory_limit_gib * GIB)

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TORCHINDUCTOR_COMPILE_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--child", what, "--threads", str(args.threads),
               "--repeats", str(args.repeats), "--check-length", str(args.check_length),
               "--dtypes", *args.dtypes, "--impls", *args.impls]
    try:
        proc = subprocess.run(command, env=env, preexec_fn=limit_memory, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout ({timeout} s)"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
    if proc.returncode < 0 or "memory" in proc.stderr.lower() or "alloc" in proc.stderr.lower():
        return {"status": "OOM", "detail": f"exit {proc.returncode}: {tail}"}
    return {"status": "error", "detail": f"exit {proc.returncode}: {tail}"}


def machine_lines(torch_version):
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return [f"machine: {cpu}, {os.cpu_count()} logical CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB, {platform.platform()}",
            f"python {platform.python_version()}, torch {torch_version}"]


def format_table(rows, repeats):
    lines = ["| n | dtype | pass | implementation | seconds (min of %d) | time / poslsh exact | peak RSS (GiB) |" % repeats,
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append("| {n} | {dtype} | {pass_} | {label} | {seconds} | {ratio} | {rss} |".format(**row))
    return "\n".join(lines)


def parent_main(args):
    import poslsh
    import torch

    header = machine_lines(torch.__version__)
    header.append(f"poslsh {poslsh.__version__} from {os.path.dirname(poslsh.__file__)}; "
                  f"threads {args.threads} (torch.set_num_threads, OMP_NUM_THREADS)")
    header.append("command: " + " ".join([os.path.basename(sys.executable), "bench/python/torch_peers_bench.py",
                                          *sys.argv[1:]]))
    for line in header:
        print(line, flush=True)

    print(f"check at n = {args.check_length}:", flush=True)
    result = run_child(args, "check", timeout=3600)
    if result.get("status") != "ok":
        sys.exit(f"torch_peers_bench: the check failed: {result}")
    for line in result["report"]:
        print("  " + line, flush=True)

    rows = []
    records = []
    for n in args.lengths:
        for dtype in args.dtypes:
            for pass_name in PASSES:
                baseline = None
                for impl in args.impls:
                    need = estimate_bytes(impl, n, dtype, pass_name != "forward")
                    free = available_bytes()
                    if impl == "flex" and pass_name != "forward":
                        # No CPU backward (the check above shows the NotImplementedError); a
                        # child would only repeat it.
                        result = {"status": "unsupported", "detail": "FlexAttention has no backward on the CPU"}
                    elif need > args.memory_limit_gib * GIB:
                        result = {"status": "OOM", "detail": f"needs ~{need / GIB:.1f} GiB > limit"}
                    elif free is not None and need > free:
                        result = {"status": "not run", "detail": f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"}
                    else:
                        result = run_child(args, f"{impl}:{n}:{dtype}:{pass_name}", timeout=args.timeout)
                    record = {"n": n, "dtype": dtype, "pass": pass_name, "impl": impl, **result}
                    records.append(record)
                    if impl == "poslsh_exact" and result["status"] == "ok":
                        baseline = result["seconds"]
                    ok = result["status"] == "ok"
                    row = {
                        "n": n, "dtype": dtype, "pass_": pass_name.replace("+", " + "), "label": LABELS[impl],
                        "seconds": f"{result['seconds']:.3f}" if ok else result["status"],
                        "ratio": f"{result['seconds'] / baseline:.2f}x" if ok and baseline else "-",
                        "rss": f"{result['peak_rss_gib']:.2f}" if "peak_rss_gib" in result else "-",
                    }
                    rows.append(row)
                    detail = f" ({result['detail']})" if "detail" in result else ""
                    print(f"  n={n} {dtype} {pass_name} {impl}: {row['seconds']} {row['ratio']}{detail}", flush=True)
    table = format_table(rows, args.repeats)
    print()
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(header) + "\n\n" + table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "check": result.get("report"), "records": records}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 4096 16384)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell after the warm-up (min)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check-length", type=int, default=512)
    parser.add_argument("--memory-limit-gib", type=float, default=20.0, help="RLIMIT_AS of each child")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: n = 1024 (unless --lengths), 1 repeat, the check at n = 256")
    parser.add_argument("--markdown", help="write the header and the table here")
    parser.add_argument("--json", help="write every cell's record here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lengths is None:
        args.lengths = [1024] if args.quick else [4096, 16384]
    if args.quick:
        args.repeats, args.check_length = 1, 256
    if min(args.lengths) < 1 or args.repeats < 1 or args.check_length < 1:
        parser.error("--lengths, --repeats and --check-length must be positive")
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
