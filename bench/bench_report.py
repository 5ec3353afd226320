#!/usr/bin/env python3
"""poslsh benchmarks: the JSON of poslsh_bench turned into the data files of plot_scaling.gp and
a Markdown report (tables and targets). Standard library only.

    python3 bench_report.py --outdir DIR poslsh_bench.json [more.json ...]

Writes DIR/<method>.dat ("n ms GFLOP/s") for every prefill method, DIR/<decoder>.dat
("t us") for every decoder, DIR/guide_{linear,quadratic}.dat, DIR/plot.gp (which panels have
data, ranges, line styles and the plot commands) and DIR/poslsh_bench.md.

The prefill methods and the decoders, in their order, with their labels, are the ones the
benchmark registered: poslsh_bench writes them into its JSON context (poslsh_methods,
poslsh_decoders), so they are listed once, in prefill_bench.cpp and decode_bench.cpp. The
targets are listed once, in TARGETS below.

Several files are merged: a row found in two files keeps the first file's figures; the date is
the first file's (e.g. the default run and a `--long --benchmark_filter=lsh_fused`
run). With --benchmark_repetitions the "min" rows are used (the least disturbed run on a shared
machine), or the median ones if there is no min. Rates of an aggregate row are recomputed from
the work of one call (rate x time of an iteration or the median) and the row's time.
"""

import argparse
import json
import math
import os
import sys

TIME_UNITS_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
# Rank of a row: an iteration 1, the median of repetitions 2, their minimum 3.
RANKS = {("iteration", ""): 1, ("aggregate", "median"): 2, ("aggregate", "min"): 3}
# Line and point styles of the plot (gnuplot colour, point type, line width), taken in order by
# the methods and by the decoders.
PALETTE = [
    ("#555555", 4, 2),
    ("#d62728", 5, 2),
    ("#ff7f0e", 9, 2),
    ("#9467bd", 11, 2),
    ("#1f77b4", 7, 3),
    ("#2ca02c", 13, 2),
    ("#8c564b", 15, 2),
    ("#e377c2", 6, 2),
]
DECODE_PALETTE = [("#1f77b4", 7, 3), ("#d62728", 5, 2), ("#2ca02c", 13, 2), ("#ff7f0e", 9, 2)]


class Rows:
    """The benchmark rows by name: time per call (ms) and GFLOP/s, best rank kept."""

    def __init__(self):
        self.ms = {}
        self.gflops = {}
        self.order = []
        self._rank = {}
        self._work = {}  # GFLOP per call
        self.context = {}

    def add_file(self, path):
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
        context = document.get("context", {})
        for key, value in context.items():
            self.context.setdefault(key, value)
        seen = set()
        for row in document.get("benchmarks", []):
            if row.get("error_occurred"):
                continue
            name = row.get("run_name") or row.get("name", "")
            rank = RANKS.get((row.get("run_type", "iteration"), row.get("aggregate_name", "")))
            if not name or rank is None or "real_time" not in row:
                continue
            if name in self._rank and name not in seen:
                continue  # an earlier file has this row: keep its figures
            seen.add(name)
            ms = float(row["real_time"]) * TIME_UNITS_MS.get(row.get("time_unit", "ns"), 1e-6)
            if rank in (1, 2) and "GFLOP" in row and name not in self._work:
                self._work[name] = float(row["GFLOP"]) * ms * 1e-3
            if name not in self._rank:
                self.order.append(name)
            if rank >= self._rank.get(name, 0):
                self._rank[name] = rank
                self.ms[name] = ms
        for name, ms in self.ms.items():
            if name in self._work and ms > 0:
                self.gflops[name] = self._work[name] / (ms * 1e-3)

    def has(self, *names):
        return all(name in self.ms for name in names)

    def sizes(self, family):
        """The n (or t, s) of the rows family/<n>, ascending."""
        prefix = family + "/"
        return sorted(int(name[len(prefix):]) for name in self.order
                      if name.startswith(prefix) and name[len(prefix):].isdigit())

    def families(self, key):
        """(name, label) pairs of the context entry `key` ("name=label;name=label")."""
        text = self.context.get(key, "")
        pairs = []
        for entry in filter(None, text.split(";")):
            name, _, label = entry.partition("=")
            pairs.append((name.strip(), label.strip() or name.strip()))
        return pairs


def fmt(x):
    if x >= 100:
        return "%.0f" % x
    if x >= 10:
        return "%.1f" % x
    if x >= 1:
        return "%.2f" % x
    return "%.3g" % x


# Targets: (text, value function, format of the measured value, test), one line each in the
# report when every row the value function reads is present (it returns None otherwise).
def _ratio_of_gflops(rows, a, b):
    if a in rows.gflops and b in rows.gflops:
        return rows.gflops[a] / rows.gflops[b]
    return None


def _time_ratio(rows, a, b):
    return rows.ms[a] / rows.ms[b] if rows.has(a, b) else None


def _percent_of_sgemm(name):
    return (lambda rows: _ratio_of_gflops(rows, name, "sgemm"),
            lambda rows, x: "%.0f%% (%s of %s GFLOP/s)" % (100 * x, fmt(rows.gflops[name]),
                                                         fmt(rows.gflops["sgemm"])))


def _targets():
    targets = []
    value, measured = _percent_of_sgemm("exact_tiled/16384")
    targets.append(("exact_tiled/16384 >= 70% of sgemm GFLOP/s", value, measured,
                    lambda x: x >= 0.70))
    for s, ratio in ((16, 4), (100, 15)):
        targets.append((
            "sigma16_fused >= %dx faster than per-sample at s = %d" % (ratio, s),
            lambda rows, s=s: _time_ratio(rows, "sigma16_per_sample/%d" % s, "sigma16_fused/%d" % s),
            lambda rows, x: "%.1fx" % x, lambda x, ratio=ratio: x >= ratio))
    for n, ratio in ((16384, 20), (32768, 40)):
        targets.append((
            "lsh_fused >= %dx faster than exact_tiled at n = %d" % (ratio, n),
            lambda rows, n=n: _time_ratio(rows, "exact_tiled/%d" % n, "lsh_fused/%d" % n),
            lambda rows, x: "%.1fx" % x, lambda x, ratio=ratio: x >= ratio))
    for n in (16384, 32768, 65536, 131072, 262144, 524288, 1048576):
        value, measured = _percent_of_sgemm("lsh_fused/%d" % n)
        targets.append(("lsh_fused/%d >= 50%% of sgemm GFLOP/s" % n, value, measured,
                        lambda x: x >= 0.5))
    for n in (32768, 65536):
        targets.append((
            "lsh_fused pairs/s at n = %d >= 0.9x those at n = 4096" % n,
            lambda rows, n=n: _ratio_of_gflops(rows, "lsh_fused/%d" % n, "lsh_fused/4096"),
            lambda rows, x: "%.2f" % x, lambda x: x >= 0.9))
    targets.append(("lsh_fused time(65536) / time(16384) <= 4.5",
                    lambda rows: _time_ratio(rows, "lsh_fused/65536", "lsh_fused/16384"),
                    lambda rows, x: "%.2f" % x, lambda x: x <= 4.5))
    targets.append(("decode_lsh per token, t = 1048576 within 2x of t = 4096",
                    lambda rows: _time_ratio(rows, "decode_lsh/1048576", "decode_lsh/4096"),
                    lambda rows, x: "%.2fx" % x, lambda x: x <= 2))
    return targets


TARGETS = _targets()


def write_data(rows, outdir, methods, decoders):
    """The .dat files and plot.gp; returns nothing."""
    max_n, max_ms = 0, 0.0
    has_prefill = has_decode = False
    for name, _ in methods:
        with open(os.path.join(outdir, name + ".dat"), "w", encoding="utf-8") as f:
            f.write("# n  ms  GFLOP/s  (%s)\n" % name)
            for n in rows.sizes(name):
                key = "%s/%d" % (name, n)
                f.write("%d %.6g %.6g\n" % (n, rows.ms[key], rows.gflops.get(key, float("nan"))))
                has_prefill = True
                max_n, max_ms = max(max_n, n), max(max_ms, rows.ms[key])
    for name, _ in decoders:
        with open(os.path.join(outdir, name + ".dat"), "w", encoding="utf-8") as f:
            f.write("# t  us per token  (%s)\n" % name)
            for t in rows.sizes(name):
                f.write("%d %.6g\n" % (t, rows.ms["%s/%d" % (name, t)] * 1e3))
                has_decode = True
    # Guides: slope 1 through lsh_fused/1024, slope 2 through exact_tiled/1024.
    with open(os.path.join(outdir, "guide_linear.dat"), "w", encoding="utf-8") as f:
        f.write("# n  ms  (slope 1)\n")
        n = 1024
        while rows.has("lsh_fused/1024") and n <= max_n:
            f.write("%d %.6g\n" % (n, rows.ms["lsh_fused/1024"] * n / 1024))
            n *= 2
    with open(os.path.join(outdir, "guide_quadratic.dat"), "w", encoding="utf-8") as f:
        f.write("# n  ms  (slope 2)\n")
        n = 1024
        while rows.has("exact_tiled/1024") and n <= min(max_n, 65536):
            f.write("%d %.6g\n" % (n, rows.ms["exact_tiled/1024"] * (n / 1024) ** 2))
            n *= 2

    def quoted(text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def plot_command(items, styles):
        parts = ["%s using 1:2 with linespoints ls %d title %s" %
                 (quoted(os.path.join(outdir, name + ".dat")), styles[name], quoted(label))
                 for name, label in items if rows.sizes(name)]
        return "plot " + ", ".join(parts) if parts else ""

    styles = {name: index + 1 for index, (name, _) in enumerate(methods)}
    lines = ["has_prefill = %d" % has_prefill, "has_decode = %d" % has_decode,
             "max_n = %d" % max_n, "max_ms = %.6g" % max_ms]
    date = str(rows.context.get("date", ""))[:16].replace("T", " ")
    lines.append("run_info = %s" % quoted(date))
    for index, (name, _) in enumerate(methods):
        colour, point, width = PALETTE[index % len(PALETTE)]
        lines.append('set style line %d lc rgb "%s" lw %d pt %d ps 1.3  # %s' %
                     (index + 1, colour, width, point, name))
    guide = len(methods) + 1
    lines.append('set style line %d lc rgb "#999999" lw 1.5 dt 2  # guides' % guide)
    prefill = plot_command(methods, styles)
    guides = [name for name, has in (("guide_quadratic", rows.has("exact_tiled/1024")),
                                     ("guide_linear", rows.has("lsh_fused/1024"))) if has]
    for index, name in enumerate(guides if prefill else []):
        prefill += ", %s using 1:2 with lines ls %d %s" % (
            quoted(os.path.join(outdir, name + ".dat")), guide,
            "notitle" if index else "title \"slope %s\"" %
            ("2 and 1" if len(guides) == 2 else "2" if name == "guide_quadratic" else "1"))
    decoder_styles = {}
    for index, (name, _) in enumerate(decoders):
        colour, point, width = DECODE_PALETTE[index % len(DECODE_PALETTE)]
        decoder_styles[name] = guide + 1 + index
        lines.append('set style line %d lc rgb "%s" lw %d pt %d ps 1.3  # %s' %
                     (guide + 1 + index, colour, width, point, name))
    lines.append("prefill_plot = %s" % quoted(prefill))
    lines.append("decode_plot = %s" % quoted(plot_command(decoders, decoder_styles)))
    with open(os.path.join(outdir, "plot.gp"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_report(rows, path, methods, decoders):
    out = []
    out.append("poslsh_bench, %s (%s cores, %s OpenMP threads)\n" %
               (rows.context.get("date", "?"), rows.context.get("num_cpus", "?"),
                rows.context.get("omp_threads", "?")))
    problem = rows.context.get("poslsh_problem", "")
    methods = [(name, label) for name, label in methods if rows.sizes(name)]
    decoders = [(name, label) for name, label in decoders if rows.sizes(name)]
    sizes = sorted({n for name, _ in methods for n in rows.sizes(name)})

    def table(title, value):
        out.append(title + "\n")
        out.append("| n | " + " | ".join(label for _, label in methods) + " |")
        out.append("|---|" + "---|" * len(methods))
        for n in sizes:
            cells = [value("%s/%d" % (name, n)) for name, _ in methods]
            out.append("| %d | %s |" % (n, " | ".join(cells)))
        out.append("")

    if methods:
        table("Prefill, time per call in ms (%s):" % problem,
              lambda key: fmt(rows.ms[key]) if rows.has(key) else "-")
    if methods:
        table("GFLOP/s at 4d FLOPs per useful pair (sgemm 2048^3: %s GFLOP/s):" %
              (fmt(rows.gflops["sgemm"]) if "sgemm" in rows.gflops else "-"),
              lambda key: fmt(rows.gflops[key]) if key in rows.gflops else "-")
    sample_counts = [s for s in rows.sizes("sigma16_fused")
                     if rows.has("sigma16_per_sample/%d" % s)]
    if sample_counts:
        out.append("Every head sigma = 16, n = 16384, time in ms:\n")
        out.append("| s | per-sample | fused | ratio |\n|---|---|---|---|")
        for s in sample_counts:
            a, b = rows.ms["sigma16_per_sample/%d" % s], rows.ms["sigma16_fused/%d" % s]
            out.append("| %d | %s | %s | %.1f |" % (s, fmt(a), fmt(b), a / b))
        out.append("")
    cache_sizes = sorted({t for name, _ in decoders for t in rows.sizes(name)})
    if cache_sizes:
        out.append("Decode, one token (8 heads, one thread) over a cache of t tokens, "
                   "us per token:\n")
        out.append("| t | " + " | ".join(label for _, label in decoders) + " |")
        out.append("|---|" + "---|" * len(decoders))
        for t in cache_sizes:
            cells = [fmt(rows.ms["%s/%d" % (name, t)] * 1e3) if rows.has("%s/%d" % (name, t))
                     else "-" for name, _ in decoders]
            out.append("| %d | %s |" % (t, " | ".join(cells)))
        out.append("")
    out.append("Targets:\n\n| target | measured | |\n|---|---|---|")
    for text, value, measured, test in TARGETS:
        x = value(rows)
        if x is None or not math.isfinite(x):
            continue
        out.append("| %s | %s | %s |" % (text, measured(rows, x), "met" if test(x) else
                                         "**not met**"))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outdir", default=".", help="directory of the outputs (default .)")
    parser.add_argument("json", nargs="+", help="poslsh_bench --benchmark_out_format=json files")
    args = parser.parse_args(argv)
    rows = Rows()
    for path in args.json:
        try:
            rows.add_file(path)
        except (OSError, ValueError) as error:
            print("bench_report.py: %s: %s" % (path, error), file=sys.stderr)
            return 1
    if not rows.order:
        print("bench_report.py: no benchmark rows in the input", file=sys.stderr)
        return 1
    methods = rows.families("poslsh_methods")
    decoders = rows.families("poslsh_decoders")
    if not methods and not decoders:
        print("bench_report.py: the JSON context lists no methods (poslsh_methods): "
              "run a poslsh_bench of this version", file=sys.stderr)
        return 1
    os.makedirs(args.outdir, exist_ok=True)
    write_data(rows, args.outdir, methods, decoders)
    write_report(rows, os.path.join(args.outdir, "poslsh_bench.md"), methods, decoders)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
