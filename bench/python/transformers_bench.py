#!/usr/bin/env python3
"""End-to-end benchmark: a BLOOM-560m-shaped transformers model (24 layers, hidden 1024, 16 heads,
a reduced vocabulary; random weights) with transformers' attention and with poslsh's.

    PYTHONPATH=python python3 bench/python/transformers_bench.py --markdown out.md
    ... --quick                                   # a check of the script: 2 layers, short lengths
    ... --parts generate --contexts 4096           # generation only (--parts prefill: prefill only)
    ... --model falcon --impls eager sdpa poslsh-exact   # Falcon-RW's layout, which has an sdpa path
    ... --lengths 2048 4096 --dtypes bfloat16 --impls eager poslsh-exact

Prefill: ``model(ids, use_cache=False, logits_to_keep=1)`` under ``torch.no_grad()`` on one
sequence of every --lengths value, per --dtypes and --impls:
  eager         transformers' eager attention (BLOOM: baddbmm with the (batch*heads, 1, L) alibi
                tensor, the (batch, 1, L, L) mask, softmax, bmm);
  sdpa          transformers' scaled_dot_product_attention path, where the model has one
                (BloomModel has none: reported as unsupported; --model falcon, Falcon-RW's
                layout of the same shape with alibi=True, has one: a dense (1, H, L, L) bias
                mask);
  poslsh-exact  poslsh.transformers.use_poslsh(model, method="exact");
  poslsh-plan   use_poslsh(model, method="plan", error=0.01) (the planner per head at 1%
                predicted relative output error).
Seconds: the minimum over --repeats timed calls after one warm-up call at 128 tokens. Peak RSS:
the child process's ``ru_maxrss`` (weights included; the RSS once the model exists is given as
the baseline).
Generation: tokens per second of greedy decoding (--gen-tokens tokens, one at a time with the
DynamicCache) after a context of every --contexts value. The context is prefilled with poslsh
exact for every implementation (the cache is transformers' DynamicCache either way, so eager can
decode at contexts whose eager prefill does not fit), then the implementation measured decodes.

Every case runs in its own child process (--threads threads for torch and OpenMP, default 2)
under an address-space limit (--memory-limit-gib, default 20 GiB, RLIMIT_AS): a case that runs
out of memory is reported as "out of memory", any other failure with its error, and the run goes
on. The tables are printed in markdown (and written to --markdown).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GIB = 1024 ** 3
IMPLS = ("eager", "sdpa", "poslsh-exact", "poslsh-plan")


def build_model(args, dtype_name, impl):
    """The BLOOM-560m-shaped model with random weights (seeded), in `dtype_name`, attention `impl`."""
    import torch
    import transformers
    torch.manual_seed(0)
    attn = "sdpa" if impl == "sdpa" else "eager"
    if args.model == "bloom":
        config = transformers.BloomConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layer=args.layers,
                                          n_head=args.heads, attn_implementation=attn)
        model = transformers.BloomForCausalLM(config)
    else:  # Falcon-RW's layout with the same shape
        config = transformers.FalconConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                           num_hidden_layers=args.layers, num_attention_heads=args.heads, alibi=True,
                                           multi_query=False, new_decoder_architecture=False, parallel_attn=False,
                                           bias=True, attn_implementation=attn)
        model = transformers.FalconForCausalLM(config)
    model = model.to(getattr(torch, dtype_name)).eval()
    if impl.startswith("poslsh"):
        import poslsh.transformers
        if impl == "poslsh-exact":
            poslsh.transformers.use_poslsh(model, method="exact")
        else:
            poslsh.transformers.use_poslsh(model, method="plan", error=args.plan_error)
    return model


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(case):
    """Runs one case (a dict) and returns its result dict."""
    import torch
    args = argparse.Namespace(**case["args"])
    torch.set_num_threads(args.threads)
    result = {"status": "ok"}
    try:
        model = build_model(args, case["dtype"], case["impl"])
    except (ValueError, ImportError) as error:
        return {"status": "unsupported", "error": str(error).split(" through ")[0].splitlines()[0][:100]}
    result["baseline_rss"] = rss_now()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if case["kind"] == "prefill":
            length = case["length"]
            model(torch.randint(0, args.vocab, (1, 128), generator=generator), use_cache=False, logits_to_keep=1)
            ids = torch.randint(0, args.vocab, (1, length), generator=generator)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                model(ids, use_cache=False, logits_to_keep=1)
                times.append(time.perf_counter() - start)
            result["seconds"] = min(times)
        else:
            import poslsh.transformers
            context = case["length"]
            ids = torch.randint(0, args.vocab, (1, context), generator=generator)
            measured = case["impl"]
            # The context is prefilled with poslsh exact (DynamicCache), then `measured` decodes.
            prefill_method = {"poslsh-plan": dict(method="plan", error=args.plan_error)}.get(measured,
                                                                                           dict(method="exact"))
            poslsh.transformers.use_poslsh(model, **prefill_method)
            out = model(ids, use_cache=True, logits_to_keep=1)
            if not measured.startswith("poslsh"):
                poslsh.transformers.restore(model)
            cache = out.cache
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, cache=cache, use_cache=True)  # one warm-up step
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(args.gen_tokens):
                out = model(token, cache=cache, use_cache=True)
                cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            result["tokens_per_second"] = args.gen_tokens / (time.perf_counter() - start)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def run_case(args, case):
    """Runs `case` in a child process under the memory limit; its result dict."""
    case = dict(case, args=vars(args))
    environment = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    limit = int(args.memory_limit_gib * GIB)

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)],
                          env=environment, capture_output=True, text=True, preexec_fn=limit_memory)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    text = done.stderr
    if done.returncode < 0:
        return {"status": f"failed (signal {-done.returncode})"}
    if "MemoryError" in text or "not enough memory" in text or "DefaultCPUAllocator" in text:
        return {"status": "out of memory"}
    last = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
    return {"status": "failed", "error": last[0][:160]}


def machine():
    """One line: the CPU, its logical CPUs, and the versions of torch, transformers and poslsh."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = subprocess.run([sys.executable, "-c", "import torch, transformers, poslsh; print(torch.__version__, "
                               "transformers.__version__, poslsh.__version__, poslsh.matrix_unit('bfloat16', "
                               "'bfloat16'))"], capture_output=True, text=True).stdout.split()
    names = ("torch", "transformers", "poslsh", "bfloat16 unit")
    return f"{cpu}, {os.cpu_count()} logical CPUs; " + ", ".join(f"{n} {v}" for n, v in zip(names, versions))


def gib(value):
    return f"{value / GIB:.2f}" if value else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--parts", nargs="+", default=["prefill", "generate"], choices=["prefill", "generate"])
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=["bloom", "falcon"], default="bloom",
                        help="BLOOM (default; transformers has no sdpa path for it) or Falcon-RW's layout "
                        "(alibi=True, with an sdpa path) of the same shape")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--plan-error", type=float, default=0.01)
    parser.add_argument("--memory-limit-gib", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true",
                        help="a check of the script: 2 layers, lengths 256 512, context 512, 4 tokens")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        try:
            result = child(json.loads(args.child))
        except MemoryError:
            result = {"status": "out of memory"}
        except RuntimeError as error:
            message = str(error)
            oom = "not enough memory" in message or "DefaultCPUAllocator" in message
            first = message.splitlines()[0][:160] if message else type(error).__name__
            result = {"status": "out of memory"} if oom else {"status": "failed", "error": first}
        print(json.dumps(result), flush=True)
        return
    if args.quick:
        args.layers, args.lengths, args.contexts, args.gen_tokens = 2, [256, 512], [512], 4

    machine_line = machine()
    print(machine_line, flush=True)
    name = "BLOOM" if args.model == "bloom" else "Falcon-RW"
    shape = (f"{name}-shaped: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary "
             f"{args.vocab}, random weights; {args.threads} threads; limit {args.memory_limit_gib:g} GiB")
    lines = [f"Prefill ({shape}): seconds (min of {args.repeats}), peak RSS and the RSS with the model built",
             "", "| dtype | tokens | attention | seconds | peak RSS [GiB] | model RSS [GiB] | status |",
             "|---|---:|---|---:|---:|---:|---|"]
    if "prefill" not in args.parts:
        lines = [shape]
    lines = [machine_line, ""] + lines
    print("\n".join(lines), flush=True)

    def run_rows(kind, lengths, cells):
        """Runs each (dtype, length, impl) case of `kind` (a part of --parts) and prints and keeps
        its table row: dtype, length, impl, cells(result) and the status."""
        for dtype in args.dtypes if kind in args.parts else []:
            for length in lengths:
                for impl in args.impls:
                    r = run_case(args, dict(kind=kind, dtype=dtype, impl=impl, length=length))
                    status = r["status"] + (f": {r['error']}" if r.get("error") else "")
                    line = "| " + " | ".join([dtype, str(length), impl, *cells(r), status]) + " |"
                    print(line, flush=True)
                    lines.append(line)

    run_rows("prefill", args.lengths,
             lambda r: [f"{r['seconds']:.3f}" if "seconds" in r else "-", gib(r.get("peak_rss")),
                        gib(r.get("baseline_rss"))])
    header = ["", f"Generation ({args.gen_tokens} greedy tokens after the context, DynamicCache): tokens/s", "",
              "| dtype | context | attention | tokens/s | peak RSS [GiB] | status |", "|---|---:|---|---:|---:|---|"]
    if "generate" in args.parts:
        print("\n".join(header), flush=True)
        lines += header
    run_rows("generate", args.contexts,
             lambda r: [f"{r['tokens_per_second']:.2f}" if "tokens_per_second" in r else "-",
                        gib(r.get("peak_rss"))])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
