#!/usr/bin/env python3
"""poslsh benchmarks: the JSON of poslsh_bench turned into tables, plots and the documentation's
figures. Standard library only.

    python3 bench_report.py --outdir DIR poslsh_bench.json [more.json ...]
    python3 bench_report.py --update-docs [--plot] --run build/bench/poslsh_bench [-- BENCH_ARGS]
    python3 bench_report.py --update-docs [--plot] build/bench/poslsh_bench_docs.json

--outdir writes DIR/<method>.dat ("n ms GFLOP/s") for every prefill method, DIR/<decoder>.dat
("t us") for every decoder, DIR/guide_{linear,quadratic}.dat, DIR/plot.gp (which panels have
data, ranges, line styles and the plot commands) and DIR/poslsh_bench.md (tables and targets).
Several files are merged: a row found in two files keeps the first file's figures; the date is
the first file's (e.g. the default run and a `--long --benchmark_filter=lsh_fused` run).

--update-docs rewrites the generated blocks of README.md, docs/benchmarks.md and
docs/model_shapes.md from ONE run (see "The documentation's figures" below): with --run it runs
poslsh_bench (the arguments after --) into a JSON stamped with the commit, the CPU and the
command, then fills every block from it; given that JSON instead, it fills them again without
running. --plot also redraws docs/images/scaling.png from the same run.

The prefill methods and the decoders, in their order, with their labels, are the ones the
benchmark registered: poslsh_bench writes them into its JSON context (poslsh_methods,
poslsh_decoders), so they are listed once, in prefill_bench.cpp and decode_bench.cpp. The
targets are listed once, in TARGETS below. With --benchmark_repetitions the "min" rows are used
(the least disturbed run on a shared machine), or the median ones if there is no min. Rates of
an aggregate row are recomputed from the work of one call (rate x time of an iteration or the
median) and the row's time.
"""

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile

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


# Counters that Google Benchmark reports per second (kIsIterationInvariantRate): an aggregate
# row's value is recomputed from the amount per call (rate x time of an iteration or the median)
# and the row's time. The other numeric counters are read from the median (or an iteration) row.
# peak_share (a kernel row's FLOP rate over its unit's peak measured right after it, peak_GFLOPs)
# is such a rate too: recomputed from the kept time, over the peak of the median (or the one) row.
RATE_COUNTERS = ("GFLOP", "exact_GFLOP", "pairs", "tokens", "peak_share", "GB")
# The peak units of the counter peak_unit (bench/peak.hpp, PeakUnit), in order.
PEAK_UNITS = ("fma_f32", "avx512_bf16", "amx_bf16")
# Numeric fields of a JSON row that are not counters.
ROW_FIELDS = {"family_index", "per_family_instance_index", "repetitions", "repetition_index",
              "threads", "iterations", "real_time", "cpu_time"}


class Rows:
    """The benchmark rows by name: time per call (ms), rates and counters, best rank kept."""

    def __init__(self):
        self.ms = {}
        self.cpu_ms = {}  # name -> CPU time per call of the whole process, ms
        self.gflops = {}
        self.rates = {}  # name -> {rate counter: per second}, from the kept time
        self.counters = {}  # name -> {counter: value} of the other counters
        self.labels = {}
        self.order = []
        self._rank = {}
        self._counter_rank = {}
        self._work = {}  # name -> {rate counter: amount per call}
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
            if rank in (1, 2):
                work = self._work.setdefault(name, {})
                for counter in RATE_COUNTERS:
                    if counter in row and counter not in work:
                        work[counter] = float(row[counter]) * ms * 1e-3
                if rank >= self._counter_rank.get(name, 0):
                    self._counter_rank[name] = rank
                    self.counters[name] = {
                        key: float(value) for key, value in row.items()
                        if key not in RATE_COUNTERS and key not in ROW_FIELDS and
                        isinstance(value, (int, float)) and not isinstance(value, bool)}
                    if row.get("label"):
                        self.labels[name] = row["label"]
            if name not in self._rank:
                self.order.append(name)
            if rank >= self._rank.get(name, 0):
                self._rank[name] = rank
                self.ms[name] = ms
                if "cpu_time" in row:
                    self.cpu_ms[name] = float(row["cpu_time"]) * TIME_UNITS_MS.get(
                        row.get("time_unit", "ns"), 1e-6)
        for name, ms in self.ms.items():
            if ms <= 0:
                continue
            self.rates[name] = {counter: amount / (ms * 1e-3)
                                for counter, amount in self._work.get(name, {}).items()}
            if "GFLOP" in self.rates[name]:
                self.gflops[name] = self.rates[name]["GFLOP"]

    def has(self, *names):
        return all(name in self.ms for name in names)

    def share(self, name):
        """The row's share of its unit's peak over CPU time: its FLOPs (row_GFLOP) over the
        process's CPU time per thread (row_threads), over peak_cpu_GFLOPs (measured right after
        it); None without those counters. Other processes on the cores lower neither side: on a
        quiet machine it is wall_share's figure."""
        counters = self.counters.get(name, {})
        if not all(counters.get(key) for key in ("row_GFLOP", "row_threads", "peak_cpu_GFLOPs")) \
                or not self.cpu_ms.get(name):
            return None
        rate = counters["row_GFLOP"] / (self.cpu_ms[name] * 1e-3 / counters["row_threads"])
        return rate / counters["peak_cpu_GFLOPs"]

    def peak_unit(self, name):
        """The unit whose peak the row is compared with (counter peak_unit), or None."""
        index = self.counters.get(name, {}).get("peak_unit")
        return None if index is None else PEAK_UNITS[int(index)]

    def wall_share(self, name):
        """The row's FLOP rate over wall time over its unit's peak over wall time measured right
        after it (peak_share), or None."""
        return self.rates.get(name, {}).get("peak_share")

    def peak(self, name):
        """The peak over CPU time (GFLOP/s) measured after the row (peak_cpu_GFLOPs), or None."""
        return self.counters.get(name, {}).get("peak_cpu_GFLOPs")

    def statistic(self):
        """What a row's time is: "min", "median" or "one run"."""
        ranks = set(self._rank.values())
        return "min" if ranks == {3} else "median" if ranks == {2} else "mixed" \
            if len(ranks) > 1 else "one run"

    def unit(self, name):
        """The matrix unit a half-precision row ran on (its label unit=...), or None."""
        label = self.labels.get(name, "")
        return label[len("unit="):] if label.startswith("unit=") else None

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


def _share_of_peak(name):
    """(value, measured) of a target on a row's share of the peak measured after it."""
    return (lambda rows: rows.share(name),
            lambda rows, x: "%.2f (%s of %s GFLOP/s)" % (x, fmt(x * rows.peak(name)),
                                                        fmt(rows.peak(name))))


# ggml's CPU flash attention (ggml_flash_attn_ext, F32 K and V, 2 threads) on the default problem
# at n = 16384 took 3.37x the time of the exact kernel evaluating every causal pair in one run on
# this machine (6037 ms against the slowest of the run's exact_tiled rows, 1793 ms, measured
# before the exact kernel dropped dead keys; docs/benchmarks.md, "Against ggml"); ggml is not
# run by the suite, so its time is this ratio times EXACT_EVERY_KEY's, the row with the same
# work per pair on every pair.
GGML_OVER_EXACT_TILED = 6037.0 / 1793.0
EXACT_EVERY_KEY = "exact_tiled_every_key/16384"


def _times_text(rows, *names):
    """The rows' times, "a / b ms" (decode rows under 10 ms: "a / b us")."""
    scale, unit = (1e3, "us") if all(name.startswith("decode") and rows.ms[name] < 10
                                     for name in names) else (1, "ms")
    return "%s %s" % (" / ".join(fmt(rows.ms[name] * scale) for name in names), unit)


def _on_unit(rows, name):
    """True when half-precision row `name` ran on a matrix unit (not widened to float)."""
    unit = rows.unit(name)
    return unit is not None and unit != "float_products"


def _targets():
    targets = []

    def time_ratio(text, slow, fast, test, unit_row=None):
        """Target on time(slow) / time(fast); only where `unit_row` ran on a matrix unit."""
        targets.append((
            text,
            lambda rows: (_time_ratio(rows, slow, fast)
                          if unit_row is None or _on_unit(rows, unit_row) else None),
            lambda rows, x: "%.2fx (%s)" % (x, _times_text(rows, slow, fast)),
            test))

    for n in (16384, 65536):
        value, measured = _percent_of_sgemm("exact_tiled_every_key/%d" % n)
        targets.append(("exact_tiled_every_key/%d >= 80%% of sgemm GFLOP/s" % n, value, measured,
                        lambda x: x >= 0.80))
    for n in (16384, 65536, 131072, 262144, 524288, 1048576):
        value, measured = _percent_of_sgemm("lsh_fused/%d" % n)
        share = 0.65 if n <= 65536 else 0.5
        targets.append(("lsh_fused/%d >= %d%% of sgemm GFLOP/s" % (n, round(100 * share)), value,
                        measured, lambda x, share=share: x >= share))
    for name, share in ((EXACT_EVERY_KEY, 0.75), ("lsh_fused/16384", 0.65)):
        value, measured = _share_of_peak(name)
        targets.append(("%s >= %.2f of the FMA peak" % (name, share), value, measured,
                        lambda x, share=share: x >= share))
    for sigma in (4, 8, 16, 32, 64, 128, 256):
        name = "lsh_fused_sigma/%d" % sigma
        value, measured = _share_of_peak(name)
        targets.append(("%s >= 0.55 of the FMA peak" % name, value, measured,
                        lambda x: x >= 0.55))
    value, measured = _share_of_peak("lsh_fused_bf16/16384")
    targets.append(("lsh_fused_bf16/16384 >= 0.55 of its unit's peak (avx512_bf16)",
                    lambda rows: value(rows) if rows.unit("lsh_fused_bf16/16384") ==
                    "avx512_bf16" else None, measured, lambda x: x >= 0.55))
    targets.append((
        "lsh_fused >= 100x faster than ggml's flash attention at n = 16384 (ggml: %.2fx "
        "%s's time)" % (GGML_OVER_EXACT_TILED, EXACT_EVERY_KEY),
        lambda rows: (_time_ratio(rows, EXACT_EVERY_KEY, "lsh_fused/16384") *
                      GGML_OVER_EXACT_TILED if rows.has(EXACT_EVERY_KEY, "lsh_fused/16384")
                      else None),
        lambda rows, x: "%.0fx (%s / %s ms)" % (
            x, fmt(rows.ms[EXACT_EVERY_KEY] * GGML_OVER_EXACT_TILED),
            fmt(rows.ms["lsh_fused/16384"])),
        lambda x: x >= 100))
    for s, ratio in ((16, 4), (100, 15)):
        time_ratio("sigma16_fused >= %dx faster than per-sample at s = %d" % (ratio, s),
                   "sigma16_per_sample/%d" % s, "sigma16_fused/%d" % s,
                   lambda x, ratio=ratio: x >= ratio)
    for n, ratio in ((16384, 20), (32768, 40)):
        time_ratio("lsh_fused >= %dx faster than exact_tiled at n = %d" % (ratio, n),
                   "exact_tiled/%d" % n, "lsh_fused/%d" % n, lambda x, ratio=ratio: x >= ratio)
    for n in (32768, 65536):
        targets.append((
            "lsh_fused pairs/s at n = %d >= 0.9x those at n = 4096" % n,
            lambda rows, n=n: _ratio_of_gflops(rows, "lsh_fused/%d" % n, "lsh_fused/4096"),
            lambda rows, x: "%.2fx" % x, lambda x: x >= 0.9))
    time_ratio("lsh_fused time(65536) / time(16384) <= 4.5", "lsh_fused/65536",
               "lsh_fused/16384", lambda x: x <= 4.5)
    time_ratio("decode_lsh per token, t = 1048576 within 2x of t = 4096", "decode_lsh/1048576",
               "decode_lsh/4096", lambda x: x <= 2)
    for method in ("exact_tiled", "lsh_fused"):
        time_ratio("%s_backward/16384 <= 2.5x its forward" % method,
                   "%s_backward/16384" % method, "%s/16384" % method, lambda x: x <= 2.5)
        time_ratio("%s_bf16_backward/16384 <= 2.5x its forward (matrix unit)" % method,
                   "%s_bf16_backward/16384" % method, "%s_bf16/16384" % method,
                   lambda x: x <= 2.5, unit_row="%s_bf16/16384" % method)
    time_ratio("lsh_fused_backward >= 20x faster than exact_tiled_backward at n = 16384",
               "exact_tiled_backward/16384", "lsh_fused_backward/16384", lambda x: x >= 20)
    for method, ratio in (("exact_tiled", 1.6), ("lsh_fused", 1.4)):
        time_ratio("%s_bf16/16384 >= %.1fx faster than float (matrix unit)" % (method, ratio),
                   "%s/16384" % method, "%s_bf16/16384" % method, lambda x, ratio=ratio: x >= ratio,
                   unit_row="%s_bf16/16384" % method)
    for row in ("lsh_fused_f16", "lsh_fused_bf16kv"):
        time_ratio("%s/16384 at least 0.9x the float row's speed" % row, "lsh_fused/16384",
                   "%s/16384" % row, lambda x: x >= 0.9)
    time_ratio("decode_lsh_bf16 >= 1.3x faster than float at t = 1048576", "decode_lsh/1048576",
               "decode_lsh_bf16/1048576", lambda x: x >= 1.3)
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
    commit = rows.context.get("poslsh_run_commit", "").split(" ")[0]
    lines.append("run_info = %s" % quoted(", ".join(filter(None, [
        "%s threads" % rows.context.get("omp_threads", "?"),
        "commit " + commit if commit else "", date]))))
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


# --- The documentation's figures -------------------------------------------------------------
#
# --update-docs rewrites, in place, the generated parts of the Markdown files (FILES below, under
# --root): every block
#
#     <!-- bench:table NAME -->
#     ...
#     <!-- /bench:table -->
#
# gets the table NAME of TABLES below, and every inline figure
#
#     <!-- bench:value KIND ROW [ROW | COUNTER] -->...<!-- /bench:value -->
#
# the value of VALUE_KINDS[KIND] (e.g. `ratio exact_tiled/16384 lsh_fused/16384`: the first
# row's time over the second's). Everything between the markers is replaced; the rest of the
# file is kept byte for byte. All the figures come from one JSON, so the files agree with each
# other. With --run the script runs poslsh_bench itself and stamps the JSON with the commit, the
# machine and the command (context entries poslsh_run_*), which the `run` tables print.

FILES = ("README.md", "docs/benchmarks.md", "docs/model_shapes.md",
         "docs/lsh_fused_efficiency.md")
# CPU flags named in the stamp, in this order: present ones listed, absent ones named as such.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
# The source tree of this script: the commit the stamp names.
SOURCE_TREE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
STAMP_KEYS = ("poslsh_run_commit", "poslsh_run_cpu", "poslsh_run_flags", "poslsh_run_build",
              "poslsh_run_command")


class MissingRow(Exception):
    """A figure needs a row the JSON does not have."""


def _git(root, *args):
    try:
        return subprocess.run(["git", "-C", root, *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _commit(root):
    """The commit of the source tree, noting changes outside the Markdown files and images."""
    commit = _git(root, "rev-parse", "--short=12", "HEAD") or "unknown"
    changed = [line[3:] for line in _git(root, "status", "--porcelain",
                                         "--untracked-files=no").splitlines()
               if not line[3:].endswith(".md") and not line[3:].startswith("docs/images/")]
    if changed:
        commit += " with uncommitted changes to %s" % ", ".join(sorted(changed))
    return commit


def _cpu():
    """(model, flags text) of this machine from /proc/cpuinfo."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip() and fields:
                    break
    except OSError:
        return "unknown CPU", "unknown flags"
    model = fields.get("model name", "unknown CPU")
    if "cpu family" in fields:
        model += " (CPU family %s, model %s)" % (fields["cpu family"], fields.get("model", "?"))
    flags = set(fields.get("flags", "").split())
    present = [flag for flag in CPU_FLAGS if flag in flags]
    absent = [flag for flag in CPU_FLAGS if flag not in flags]
    text = ", ".join(present) if present else "none of the listed"
    if absent:
        text += "; no " + ", ".join(absent)
    return model, text


def _build(binary):
    """Compiler, build type and -march=native of the build tree holding `binary`."""
    directory = os.path.dirname(os.path.abspath(binary))
    cache = {}
    while True:
        path = os.path.join(directory, "CMakeCache.txt")
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, _, value = line.partition("=")
                    cache[key.split(":")[0]] = value.strip()
            break
        parent = os.path.dirname(directory)
        if parent == directory:
            return "unknown build"
        directory = parent
    compiler = cache.get("CMAKE_CXX_COMPILER", "")
    try:
        version = subprocess.run([compiler, "--version"], check=True, capture_output=True,
                                 text=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        version = compiler or "unknown compiler"
    parts = [version, cache.get("CMAKE_BUILD_TYPE") or "no build type"]
    if cache.get("POSLSH_NATIVE", "").upper() in ("ON", "TRUE", "1", "YES"):
        parts.append("-march=native")
    if cache.get("CMAKE_CXX_FLAGS"):
        parts.append(cache["CMAKE_CXX_FLAGS"])
    return ", ".join(parts)


def _relative(path, root):
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, root)
    return absolute if relative.startswith("..") else relative


def make_stamp(binary, command):
    model, flags = _cpu()
    return {"poslsh_run_commit": _commit(SOURCE_TREE), "poslsh_run_cpu": model,
            "poslsh_run_flags": flags, "poslsh_run_build": _build(binary) if binary else
            "unknown build", "poslsh_run_command": command}


def run_benchmark(binary, json_path, bench_args, stamp):
    """Runs `binary bench_args` into json_path and writes the stamp into its context."""
    command = [binary, *bench_args, "--benchmark_out=" + json_path,
               "--benchmark_out_format=json"]
    print("bench_report.py: running %s" % " ".join(shlex.quote(c) for c in command),
          file=sys.stderr)
    subprocess.run(command, check=True)
    with open(json_path, encoding="utf-8") as f:
        document = json.load(f)
    document.setdefault("context", {}).update(stamp)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def _need(rows, *names):
    missing = [name for name in names if name not in rows.ms]
    if missing:
        raise MissingRow(", ".join(missing))


def _need_any(items, missing):
    """MissingRow(missing) when a table has nothing to show (no items)."""
    if not items:
        raise MissingRow(missing)


def _ms(rows, name):
    return fmt(rows.ms[name]) if name in rows.ms else "-"


def _ratio_text(x):
    return ("%.0fx" if x >= 10 else "%.1fx" if x >= 2 else "%.2fx") % x


def _value_ms(rows, stamp, name):
    _need(rows, name)
    return fmt(rows.ms[name])


def _value_us(rows, stamp, name):
    _need(rows, name)
    return fmt(rows.ms[name] * 1e3)


def _value_ratio(rows, stamp, slow, fast):
    _need(rows, slow, fast)
    return _ratio_text(rows.ms[slow] / rows.ms[fast])


def _value_gflops(rows, stamp, name):
    _need(rows, name)
    if name not in rows.gflops:
        raise MissingRow(name + " GFLOP")
    return fmt(rows.gflops[name])


def _value_sgemm(rows, stamp, name):
    _need(rows, name, "sgemm")
    if name not in rows.gflops:
        raise MissingRow(name + " GFLOP")
    return "%.0f%%" % (100 * rows.gflops[name] / rows.gflops["sgemm"])


def _value_counter(rows, stamp, name, counter):
    _need(rows, name)
    if counter not in rows.counters.get(name, {}):
        raise MissingRow("%s counter %s" % (name, counter))
    return fmt(rows.counters[name][counter])


def _value_keys(rows, stamp, name):
    return _value_counter(rows, stamp, name, "keys_per_query")


def _value_run(rows, stamp):
    """The run in a few words: commit, CPU, the flags that matter, threads."""
    present = stamp["poslsh_run_flags"].split("; no ")[0].split(", ")
    flags = [flag for flag in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
             if flag in present]
    if "amx_tile" not in present:
        flags.append("no AMX")
    return "%s, %s threads (commit `%s`)" % (
        stamp["poslsh_run_cpu"] + (" with " + ", ".join(flags) if flags else ""),
        rows.context.get("omp_threads", "?"), stamp["poslsh_run_commit"].split(" ")[0])


# <!-- bench:value KIND ARGS -->: KIND -> (function(rows, stamp, *ARGS), number of ARGS).
VALUE_KINDS = {
    "run": (_value_run, 0),  # commit, CPU, flags and threads of the run
    "ms": (_value_ms, 1),  # time per call of a row, in ms
    "us": (_value_us, 1),  # time per call of a row, in us
    "ratio": (_value_ratio, 2),  # time of the first row over the second's, "26x" or "1.8x"
    "gflops": (_value_gflops, 1),  # GFLOP/s at 4 d FLOPs per useful pair
    "sgemm": (_value_sgemm, 1),  # GFLOP/s as a percentage of the sgemm row's
    "keys": (_value_keys, 1),  # mean keys per query row
    "counter": (_value_counter, 2),  # any other counter of a row
}


def _share_text(rows, name):
    share = rows.share(name)
    return "%.2f" % share if share is not None else "-"


def _table(header, rows_of_cells):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in rows_of_cells]
    return out


def _statistic_text(rows):
    return {"min": "each row the fastest of its repetitions",
            "median": "each row the median of its repetitions",
            "one run": "each row one run (no repetitions)",
            "mixed": "rows with repetitions: the fastest; the others: one run"}[rows.statistic()]


def table_run(rows, stamp):
    context = rows.context
    date = str(context.get("date", "?"))[:16].replace("T", " ")
    units = context.get("poslsh_matrix_units", "").replace(",", ", ")
    return [
        "- commit: `%s` (poslsh %s), run %s" % (stamp["poslsh_run_commit"],
                                              context.get("poslsh_version", "?"), date),
        "- CPU: %s, %s cores, %s OpenMP threads; %s" % (
            stamp["poslsh_run_cpu"], context.get("num_cpus", "?"),
            context.get("omp_threads", "?"), stamp["poslsh_run_flags"]),
        "- matrix units for half-precision products: %s" % (units or "?"),
        "- build: %s" % stamp["poslsh_run_build"],
        "- command: `%s`; %s" % (stamp["poslsh_run_command"], _statistic_text(rows)),
    ]


def _prefill_sizes(rows, methods):
    return sorted({n for name, _ in methods for n in rows.sizes(name)})


def _prefill_methods(rows):
    """The (name, label) of each method of poslsh_methods with prefill rows; MissingRow if none."""
    methods = [(name, label) for name, label in rows.families("poslsh_methods")
               if rows.sizes(name)]
    _need_any(methods, "the prefill rows (<method>/<n>)")
    return methods


def table_prefill(rows, stamp, max_n=None):
    methods = _prefill_methods(rows)
    return _table(["n"] + [label for _, label in methods],
                  [[str(n)] + [_ms(rows, "%s/%d" % (name, n)) for name, _ in methods]
                   for n in _prefill_sizes(rows, methods) if max_n is None or n <= max_n])


def table_prefill_short(rows, stamp):
    """table_prefill without the --long rows (n > 65536)."""
    return table_prefill(rows, stamp, max_n=65536)


def table_gflops(rows, stamp):
    _need(rows, "sgemm")
    methods = _prefill_methods(rows)

    def cell(key):
        if key not in rows.gflops:
            return "-"
        share = rows.share(key)
        return "%s (%s)" % (fmt(rows.gflops[key]), "%.2f" % share if share is not None else "-")

    sgemm_share = rows.share("sgemm")
    out = ["`sgemm` (Eigen, 2048^3): %s GFLOP/s%s. GFLOP/s of each row (its share of the float32 "
           "FMA peak measured right after it):" % (
               fmt(rows.gflops["sgemm"]),
               ", %.2f of the FMA peak" % sgemm_share if sgemm_share is not None else ""), ""]
    out += _table(["n"] + [label for _, label in methods],
                  [[str(n)] + [cell("%s/%d" % (name, n)) for name, _ in methods]
                   for n in _prefill_sizes(rows, methods)])
    keys = [(label, name) for name, label in methods if "%s/16384" % name in rows.counters]
    if keys:
        out += ["", "Keys per query at n = 16384: " + ", ".join(
            "%s %s" % (label, fmt(rows.counters["%s/16384" % name]["keys_per_query"]))
            for label, name in keys if "keys_per_query" in rows.counters["%s/16384" % name]) +
            "."]
    return out


def table_targets(rows, stamp):
    cells = []
    for text, value, measured, test in TARGETS:
        x = value(rows)
        if x is None or not math.isfinite(x):
            continue
        cells.append([text, measured(rows, x), "met" if test(x) else "**not met**"])
    _need_any(cells, "the rows of every target")
    return _table(["target", "measured", ""], cells)


def table_sigma16(rows, stamp):
    counts = [s for s in rows.sizes("sigma16_fused") if rows.has("sigma16_per_sample/%d" % s)]
    _need_any(counts, "sigma16_per_sample/<s>, sigma16_fused/<s>")
    cells = []
    for s in counts:
        a, b = rows.ms["sigma16_per_sample/%d" % s], rows.ms["sigma16_fused/%d" % s]
        keys = rows.counters.get("sigma16_fused/%d" % s, {}).get("keys_per_query")
        cells.append([str(s), fmt(a), fmt(b), _ratio_text(a / b),
                      fmt(keys) if keys is not None else "-"])
    return _table(["s", "per-sample (ms)", "fused (ms)", "per-sample / fused",
                   "fused keys per query"], cells)


def table_by_sigma(rows, stamp):
    sigmas = rows.sizes("lsh_fused_sigma")
    _need_any(sigmas, "lsh_fused_sigma/<sigma>")
    cells = []
    for sigma in sigmas:
        name = "lsh_fused_sigma/%d" % sigma
        keys = rows.counters.get(name, {}).get("keys_per_query")
        cells.append([str(sigma), fmt(rows.ms[name]), fmt(rows.ms[name] / 8),
                      fmt(keys) if keys is not None else "-",
                      fmt(rows.gflops[name]) if name in rows.gflops else "-",
                      _share_text(rows, name)])
    out = _table(["sigma", "8 heads (ms)", "one head: 1/8 (ms)", "keys per query", "GFLOP/s",
                  "share of FMA peak"], cells)
    if rows.has("lsh_fused/16384") and len(sigmas) == 8:
        out += ["", "The eighths add up to %s ms; `lsh_fused/16384` (the eight sigmas, one head "
                "each) took %s ms in this run." % (
                    fmt(sum(rows.ms["lsh_fused_sigma/%d" % s] for s in sigmas) / 8),
                    fmt(rows.ms["lsh_fused/16384"]))]
    return out


def table_decode(rows, stamp):
    decoders = [(name, label) for name, label in rows.families("poslsh_decoders")
                if rows.sizes(name)]
    _need_any(decoders, "decode_<kernel>/<t>")
    sizes = sorted({t for name, _ in decoders for t in rows.sizes(name)})
    return _table(["t"] + [label + " (us)" for _, label in decoders],
                  [[str(t)] + [fmt(rows.ms["%s/%d" % (name, t)] * 1e3)
                               if rows.has("%s/%d" % (name, t)) else "-"
                               for name, _ in decoders] for t in sizes])


def table_half(rows, stamp):
    n = 16384
    cells = []
    for float_row, variants in (
            ("exact_tiled", ("exact_tiled_bf16", "exact_tiled_bf16_avx512_bf16",
                             "exact_tiled_bf16_float_products")),
            ("lsh_fused", ("lsh_fused_bf16", "lsh_fused_bf16_avx512_bf16",
                           "lsh_fused_bf16_float_products", "lsh_fused_f16",
                           "lsh_fused_f16_float_products", "lsh_fused_bf16kv"))):
        base = "%s/%d" % (float_row, n)
        if base not in rows.ms:
            continue
        cells.append(["`%s`" % base, "float", fmt(rows.ms[base]) + " ms", "",
                      _share_text(rows, base)])
        for variant in variants:
            name = "%s/%d" % (variant, n)
            if name in rows.ms:
                unit = rows.unit(name) or ("float_products" if "float_products" in variant
                                           else "float products, bfloat16 K, V"
                                           if variant.endswith("bf16kv") else "-")
                cells.append(["`%s`" % name, unit, fmt(rows.ms[name]) + " ms",
                              "%.2fx" % (rows.ms[base] / rows.ms[name]), _share_text(rows, name)])
    for decoder in ("decode_lsh", "decode_exact"):
        for t in (65536, 1048576):
            base, name = "%s/%d" % (decoder, t), "%s_bf16/%d" % (decoder, t)
            if rows.has(base, name):
                cells.append(["`%s`" % name, "bfloat16 cache, float arithmetic",
                              _times_text(rows, name) + " per token",
                              "%.2fx (float: %s)" % (rows.ms[base] / rows.ms[name],
                                                     _times_text(rows, base)), "-"])
    _need_any(cells, "the half-precision rows at n = 16384")
    return _table(["row", "unit", "time", "float time / this",
                   "share of the unit's peak (float: FMA)"], cells)


def table_backward(rows, stamp):
    sizes = sorted(set(rows.sizes("exact_tiled_backward")) | set(rows.sizes("lsh_fused_backward")))

    def pair(forward, backward):
        shares = "%s / %s" % (_share_text(rows, forward), _share_text(rows, backward))
        if not rows.has(forward, backward):
            return [_ms(rows, forward), _ms(rows, backward), "-", shares]
        return [fmt(rows.ms[forward]), fmt(rows.ms[backward]),
                "%.2fx" % (rows.ms[backward] / rows.ms[forward]), shares]

    cells = []
    for n in sizes:
        for suffix, label in (("", str(n)), ("_bf16", "%d, bfloat16" % n)):
            exact = ("exact_tiled%s/%d" % (suffix, n), "exact_tiled%s_backward/%d" % (suffix, n))
            fused = ("lsh_fused%s/%d" % (suffix, n), "lsh_fused%s_backward/%d" % (suffix, n))
            if not (rows.has(exact[1]) or rows.has(fused[1])):
                continue
            cells.append([label] + pair(*exact) + pair(*fused) + [
                _ratio_text(rows.ms[exact[1]] / rows.ms[fused[1]])
                if rows.has(exact[1], fused[1]) else "-"])
    _need_any(cells, "<method>_backward/<n>")
    return _table(["n", "exact fwd (ms)", "exact bwd (ms)", "bwd / fwd",
                   "exact share of peak: fwd / bwd", "fused fwd (ms)", "fused bwd (ms)",
                   "bwd / fwd", "fused share of peak: fwd / bwd", "exact bwd / fused bwd"], cells)


def table_paged(rows, stamp):
    cells = []
    for method, label in (("lsh_fused", "fused LSH"), ("exact_tiled", "exact tiled")):
        for m, what in ((4096, "prefill, m = 4096"), (64, "last m = 64")):
            base = "paged/%s/contiguous/%d" % (method, m)
            if base not in rows.ms:
                continue
            cells.append(["%s, %s" % (label, what), fmt(rows.ms[base])] + [
                "%.2fx" % (rows.ms[base] / rows.ms["paged/%s/page%d/%d" % (method, p, m)])
                if rows.has("paged/%s/page%d/%d" % (method, p, m)) else "-"
                for p in (16, 64, 256)])
    _need_any(cells, "paged/<method>/<layout>/<m>")
    return _table(["kernel, queries", "contiguous (ms)", "P = 16", "P = 64", "P = 256"], cells)


def table_single_head(rows, stamp):
    kernels = ("single_exact_tiled", "single_exact_banded", "single_lsh_fused",
               "single_lsh_fused_sigma2")
    sizes = sorted({n for kernel in kernels for n in rows.sizes(kernel)})
    _need_any(sizes, "single_<kernel>/<n>")
    header = ["row"] + ["n = %d (ms)" % n for n in sizes] + [
        "GFLOP/s at n = %d" % sizes[-1], "share of FMA peak at n = %d" % sizes[-1]]
    cells = []
    for kernel in kernels:
        if not rows.sizes(kernel):
            continue
        last = "%s/%d" % (kernel, sizes[-1])
        cells.append(["`%s`" % kernel] + [_ms(rows, "%s/%d" % (kernel, n)) for n in sizes] +
                     [fmt(rows.gflops[last]) if last in rows.gflops else "-",
                      _share_text(rows, last)])
    return _table(header, cells)


def table_peak(rows, stamp):
    units = [name for name in rows.order if name.startswith("peak/")]
    _need_any(units, "peak/<unit>")
    cells = []
    for name in units:
        label = rows.labels.get(name, "")
        counters = rows.counters.get(name, {})
        bandwidth = rows.rates.get(name, {}).get("GB")
        cells.append(["`%s`" % name, label.replace("unit=", "").replace(",isa=", ", ") or
                      "memory reads", "%d" % counters.get("threads_used", 0),
                      fmt(rows.gflops[name]) if name in rows.gflops else
                      "%s GB/s" % fmt(bandwidth) if bandwidth else "-",
                      fmt(counters["cpu_GFLOPs"]) if "cpu_GFLOPs" in counters else "-"])
    out = _table(["row", "unit", "threads",
                  "GFLOP/s over wall time (mean of a repetition's runs)",
                  "GFLOP/s over the threads' CPU time (best run)"], cells)
    kernels = [name for name in rows.order if rows.counters.get(name, {}).get("row_threads", 0) > 1
               and rows.peak_unit(name) == "fma_f32" and name != "sgemm"
               and rows.counters[name].get("peak_GFLOPs")]
    if kernels:
        wall = [rows.counters[name]["peak_GFLOPs"] for name in kernels]
        cpu = [rows.peak(name) for name in kernels if rows.peak(name)]
        out += ["", "Measured again after each of the %d float kernel rows on all threads: %s to "
                "%s GFLOP/s over wall time, %s to %s over CPU time." % (
                    len(kernels), fmt(min(wall)), fmt(max(wall)), fmt(min(cpu)), fmt(max(cpu)))]
    return out


def _thread_ms(rows, name):
    """CPU time per call per thread of a row in ms (its wall time on a quiet machine)."""
    threads = rows.counters.get(name, {}).get("row_threads")
    if not threads or not rows.cpu_ms.get(name):
        return "-"
    return fmt(rows.cpu_ms[name] / threads)


# The rows of the shares table, in order (those the run has).
SHARE_ROWS = ("sgemm", "exact_tiled/16384", "exact_tiled_every_key/16384", "exact_tiled_bf16/16384",
              "lsh_fused/16384", "lsh_fused/65536", "lsh_fused_bf16/16384", "lsh_fused_f16/16384",
              "lsh_fused_bf16kv/16384", "banded/16384", "exact_tiled_backward/16384",
              "exact_tiled_every_key_backward/16384",
              "exact_tiled_bf16_backward/16384", "lsh_fused_backward/16384",
              "lsh_fused_bf16_backward/16384", "single_exact_tiled/16384",
              "single_lsh_fused/16384", "single_lsh_fused_sigma2/16384")


def table_shares(rows, stamp):
    cells = []
    by_sigma = tuple("%s/%d" % (family, s) for family in ("lsh_fused_sigma", "lsh_fused_bf16_sigma")
                     for s in rows.sizes(family))
    for name in SHARE_ROWS + by_sigma:
        share = rows.share(name)
        if share is None:
            continue
        cells.append(["`%s`" % name, rows.peak_unit(name) or "fma_f32",
                      "2 n^3 a call" if name == "sgemm" else "10 d" if "backward" in name
                      else "4 d", fmt(share * rows.peak(name)), fmt(rows.peak(name)),
                      "%.2f" % share])
    _need_any(cells, "kernel rows with peak counters (peak_cpu_GFLOPs)")
    return _table(["row", "peak of", "FLOPs per pair", "GFLOP/s", "peak (GFLOP/s)",
                   "share of the peak"], cells)


def table_phases(rows, stamp):
    sigmas = rows.sizes("lsh_fused_phase/counts")
    _need_any(sigmas, "lsh_fused_phase/<phase>/<sigma>")
    cells = []
    for sigma in sigmas:
        fused = "lsh_fused_sigma/%d" % sigma
        window, counts, build, memory = ("lsh_fused_phase/%s/%d" % (phase, sigma)
                                         for phase in ("window", "counts", "build", "memory"))
        useful = rows.rates.get(counts, {}).get("pairs", 0) * rows.ms.get(counts, 0) * 1e-3
        evaluated = rows.counters.get(counts, {}).get("evaluated_pairs")
        cells.append([str(sigma), "%.0f" % (useful / (16384 * 8)) if useful else "-",
                      _thread_ms(rows, fused), _share_text(rows, fused),
                      _thread_ms(rows, window), _share_text(rows, window),
                      _thread_ms(rows, counts), _thread_ms(rows, build), _thread_ms(rows, memory),
                      "%.2f" % (evaluated / useful) if evaluated and useful else "-"])
    return _table(["sigma", "keys per query", "fused (ms)", "fused share",
                   "same pairs, no counts (ms)", "its share", "counts alone (ms)",
                   "of which query tiles (ms)", "bytes alone (ms)", "evaluated / useful pairs"],
                  cells)


MODEL_NAMES = {"bloom-7b1": "BLOOM-7b1", "bloom-3b": "BLOOM-3b", "mpt-30b": "MPT-30B",
               "replit-code-v1.5": "Replit-code-v1.5", "refact-1.6b": "Refact-1.6B",
               "jinabert-v2-base": "JinaBERT-v2-base", "mpt-7b-storywriter": "MPT-7B-StoryWriter"}


def table_models(rows, stamp):
    models = []
    for name in rows.order:
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == "model" and (parts[1], parts[3]) not in models:
            models.append((parts[1], parts[3]))
    _need_any(models, "model/<name>/<method>/<n>")
    cells = []
    for model, n in models:
        row = lambda method: "model/%s/%s/%s" % (model, method, n)
        exact, banded, fused, fused_kv = (row("exact_tiled"), row("exact_banded"),
                                          row("lsh_fused"), row("lsh_fused_bf16kv"))

        def exact_rate(name):
            rate = rows.rates.get(name, {}).get("exact_GFLOP")
            return fmt(rate) if rate is not None else "-"

        def keys(name):
            value = rows.counters.get(name, {}).get("keys_per_query")
            return fmt(value) if value is not None else "-"

        shares = rows.counters.get(fused, {})
        cells.append([
            "%s (%s)" % (MODEL_NAMES.get(model, model), n), _ms(rows, exact), _ms(rows, banded),
            _ms(rows, fused), _ms(rows, fused_kv),
            " / ".join(exact_rate(name) for name in (exact, banded, fused)),
            " / ".join(keys(name) for name in (exact, banded, fused)),
            _ratio_text(rows.ms[exact] / rows.ms[banded]) if rows.has(exact, banded) else "-",
            _ratio_text(rows.ms[exact] / rows.ms[fused]) if rows.has(exact, fused) else "-",
            "%.0f%% / %.0f%%" % (100 * shares["widest_head_share"],
                                 100 * shares["widest_quarter_share"])
            if "widest_head_share" in shares and "widest_quarter_share" in shares else "-"])
    return _table(["model (n)", "exact tiled (ms)", "banded (ms)", "fused LSH (ms)",
                   "fused, bfloat16 K, V (ms)", "exact-equivalent GFLOP/s: tiled / banded / fused",
                   "keys per query: tiled / banded / fused", "tiled / banded", "tiled / fused",
                   "fused: widest head / widest quarter of the time"], cells)


# <!-- bench:table NAME -->: NAME -> function(rows, stamp) returning the block's lines.
TABLES = {
    "run": table_run,
    "peak": table_peak,
    "shares": table_shares,
    "phases": table_phases,
    "prefill": table_prefill,
    "prefill_short": table_prefill_short,
    "gflops": table_gflops,
    "targets": table_targets,
    "sigma16": table_sigma16,
    "by_sigma": table_by_sigma,
    "decode": table_decode,
    "half": table_half,
    "backward": table_backward,
    "paged": table_paged,
    "single_head": table_single_head,
    "models": table_models,
}

TABLE_BLOCK = re.compile(r"(<!-- bench:table (\S+) -->\n)(.*?)(<!-- /bench:table -->)", re.S)
VALUE_MARK = re.compile(r"(<!-- bench:value ([^>]*?) -->)(.*?)(<!-- /bench:value -->)")


def render_file(text, rows, stamp, allow_missing, problems):
    """`text` with every generated block and figure replaced; problems collects what failed."""

    def table(match):
        name = match.group(2)
        if name not in TABLES:
            problems.append("unknown table '%s'" % name)
            return match.group(0)
        try:
            body = "\n" + "\n".join(TABLES[name](rows, stamp)) + "\n\n"
        except MissingRow as missing:
            if not allow_missing:
                problems.append("table '%s' needs %s" % (name, missing))
            return match.group(0)
        return match.group(1) + body + match.group(4)

    def value(match):
        words = match.group(2).split()
        if not words or words[0] not in VALUE_KINDS or len(words) - 1 != VALUE_KINDS[words[0]][1]:
            problems.append("bad figure '%s'" % match.group(2))
            return match.group(0)
        try:
            figure = VALUE_KINDS[words[0]][0](rows, stamp, *words[1:])
        except MissingRow as missing:
            if not allow_missing:
                problems.append("figure '%s' needs %s" % (match.group(2), missing))
            return match.group(0)
        return match.group(1) + figure + match.group(4)

    return VALUE_MARK.sub(value, TABLE_BLOCK.sub(table, text))


def update_docs(root, rows, stamp, allow_missing, dry_run):
    """Rewrites FILES under root; returns 0, or 1 if a figure could not be made."""
    problems, rendered = [], {}
    for relative in FILES:
        path = os.path.join(root, relative)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        file_problems = []
        rendered[path] = (text, render_file(text, rows, stamp, allow_missing, file_problems))
        problems += ["%s: %s" % (relative, problem) for problem in file_problems]
    if problems:
        for problem in problems:
            print("bench_report.py: %s" % problem, file=sys.stderr)
        print("bench_report.py: nothing written (run the rows, or --allow-missing to keep the "
              "old figures where rows are missing)", file=sys.stderr)
        return 1
    for path, (old, new) in rendered.items():
        status = "unchanged" if old == new else "would update" if dry_run else "updated"
        if old != new and not dry_run:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        print("bench_report.py: %s %s" % (status, _relative(path, root)), file=sys.stderr)
    return 0


def plot_to(path, rows, gnuplot):
    """The scaling plot of `rows` (plot_scaling.gp) written to path."""
    methods = rows.families("poslsh_methods")
    decoders = rows.families("poslsh_decoders")
    with tempfile.TemporaryDirectory() as data:
        write_data(rows, data, methods, decoders)
        subprocess.run([gnuplot, "-e", "datadir='%s'; output='%s'" % (data, path),
                        os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "plot_scaling.gp")], check=True)


def report_main(args):
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


def docs_main(args, bench_args):
    root = os.path.abspath(args.root)
    if any(arg.startswith("--benchmark_filter") for arg in bench_args) and not args.allow_missing:
        print("bench_report.py: a run of part of the suite (--benchmark_filter) cannot update the "
              "documentation (--allow-missing, for trying the script only)", file=sys.stderr)
        return 2
    if args.run:
        json_path = args.json[0] if args.json else os.path.join(
            os.path.dirname(os.path.abspath(args.run)), "poslsh_bench_docs.json")
        command = ["python3", _relative(__file__, SOURCE_TREE), "--update-docs"]
        command += ["--plot"] if args.plot else []
        command += ["--run", _relative(args.run, SOURCE_TREE)]
        command += ["--", *bench_args] if bench_args else []
        text = " ".join(shlex.quote(word) for word in command)
        if os.environ.get("OMP_NUM_THREADS"):
            text = "OMP_NUM_THREADS=%s %s" % (os.environ["OMP_NUM_THREADS"], text)
        try:
            run_benchmark(args.run, json_path, bench_args, make_stamp(args.run, text))
        except (OSError, subprocess.CalledProcessError, ValueError) as error:
            print("bench_report.py: %s" % error, file=sys.stderr)
            return 1
    elif len(args.json) == 1 and not bench_args:
        json_path = args.json[0]
    else:
        print("bench_report.py: --update-docs takes --run BENCH [-- BENCH_ARGS] or one JSON",
              file=sys.stderr)
        return 2
    rows = Rows()
    try:
        rows.add_file(json_path)
    except (OSError, ValueError) as error:
        print("bench_report.py: %s: %s" % (json_path, error), file=sys.stderr)
        return 1
    stamp = {key: rows.context[key] for key in STAMP_KEYS if key in rows.context}
    if len(stamp) != len(STAMP_KEYS):
        print("bench_report.py: %s has no run stamp (not written by --run): the commit and the "
              "CPU named are this tree's and this machine's" % json_path, file=sys.stderr)
        stamp = make_stamp(None, "poslsh_bench, JSON %s" % _relative(json_path, SOURCE_TREE))
    if "--benchmark_filter" in stamp["poslsh_run_command"] and not args.allow_missing:
        print("bench_report.py: %s is a run of part of the suite (--benchmark_filter)" %
              json_path, file=sys.stderr)
        return 2
    status = update_docs(root, rows, stamp, args.allow_missing, args.dry_run)
    if status == 0 and args.plot and not args.dry_run:
        path = os.path.join(root, "docs", "images", "scaling.png")
        try:
            plot_to(path, rows, args.gnuplot)
        except (OSError, subprocess.CalledProcessError) as error:
            print("bench_report.py: plot: %s" % error, file=sys.stderr)
            return 1
        print("bench_report.py: updated %s" % _relative(path, root), file=sys.stderr)
    return status


def main(argv):
    bench_args = []
    if "--" in argv:
        argv, bench_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Modes: --outdir DIR JSON... (tables, targets and plot data of any runs); "
        "--update-docs --run BENCH [-- BENCH_ARGS] (one run, its figures written into "
        "the documentation); --update-docs JSON (the same from the JSON of an earlier --run).")
    parser.add_argument("--outdir", default=".", help="directory of the outputs (default .)")
    parser.add_argument("--update-docs", action="store_true",
                        help="rewrite the generated blocks of %s under --root" % ", ".join(FILES))
    parser.add_argument("--run", metavar="BENCH",
                        help="with --update-docs: run this poslsh_bench (arguments after --) "
                        "into the JSON (default: poslsh_bench_docs.json next to BENCH)")
    parser.add_argument("--root", default=SOURCE_TREE,
                        help="tree whose files are rewritten (default: this script's)")
    parser.add_argument("--plot", action="store_true",
                        help="with --update-docs: also write docs/images/scaling.png (gnuplot)")
    parser.add_argument("--gnuplot", default="gnuplot", help="gnuplot program for --plot")
    parser.add_argument("--allow-missing", action="store_true",
                        help="with --update-docs: keep the old figures of blocks whose rows "
                        "the JSON lacks (for trying a subset of rows; do not commit the result)")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --update-docs: check every block, write nothing")
    parser.add_argument("json", nargs="*", help="poslsh_bench --benchmark_out_format=json files")
    args = parser.parse_args(argv)
    if args.update_docs:
        return docs_main(args, bench_args)
    if bench_args or args.run or not args.json:
        parser.error("--outdir mode takes JSON files only")
    return report_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
