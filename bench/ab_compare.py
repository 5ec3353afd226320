#!/usr/bin/env python3
"""Compare two builds of poslsh_bench row by row, alternating them.

    bench/ab_compare.py BEFORE_BENCH AFTER_BENCH --filter REGEX [--rounds 3] [--min-time 0.5]
                        [--time real|cpu]

Runs BEFORE, AFTER, BEFORE, AFTER, ... (--rounds times each) with the same
--benchmark_filter, so both builds see the same machine state in turn, keeps for every row
the smallest real time over the rounds, and prints a Markdown table: the row, both times in
ms and the ratio after / before (below 1: the after build is faster). --time cpu compares the
rows' CPU time instead (the process's, all threads, for the rows that measure it): on a machine
shared with other jobs it moves less with their load than the real time. Standard library only.
"""

import argparse
import json
import subprocess
import sys
import tempfile


def run(binary, pattern, min_time, extra, field="real_time"):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [binary, f"--benchmark_filter={pattern}", f"--benchmark_min_time={min_time}",
                   f"--benchmark_out={out.name}", "--benchmark_out_format=json", *extra]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        report = json.load(open(out.name))
    times = {}
    for row in report["benchmarks"]:
        if row.get("run_type") == "aggregate" and row.get("aggregate_name") != "min":
            continue
        name = row.get("run_name", row["name"]).split("/min_time")[0].split("/real_time")[0]
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[row.get("time_unit", "ns")]
        value = row[field] * scale
        times[name] = min(value, times.get(name, float("inf")))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--filter", required=True, help="Google Benchmark --benchmark_filter")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--time", choices=("real", "cpu"), default="real",
                        help="compare real time (default) or CPU time")
    parser.add_argument("extra", nargs="*", help="further flags for both binaries")
    args = parser.parse_args()
    best = {"before": {}, "after": {}}
    for _ in range(args.rounds):
        for label in ("before", "after"):
            times = run(getattr(args, label), args.filter, args.min_time, args.extra,
                        args.time + "_time")
            for name, value in times.items():
                best[label][name] = min(value, best[label].get(name, float("inf")))
    print("| row | before (ms, %s time) | after (ms) | after / before |" % args.time)
    print("|---|---|---|---|")
    for name in best["before"]:
        if name not in best["after"]:
            continue
        before, after = best["before"][name], best["after"][name]
        print(f"| {name} | {before:.4g} | {after:.4g} | {after / before:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
