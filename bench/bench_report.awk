# poslsh benchmarks: the JSON of poslsh_bench (--benchmark_out_format=json) turned into the data
# files of plot_scaling.gp and a Markdown report (tables and the issue's targets).
#   awk -v outdir=DIR -f bench_report.awk poslsh_bench.json [more.json ...]
# Writes DIR/<method>.dat ("n ms GFLOP/s"), DIR/decode_{lsh,exact}.dat ("t us"),
# DIR/guide_{linear,quadratic}.dat, DIR/flags.gp (which panels have data, ranges) and
# DIR/poslsh_bench.md. POSIX awk (Debian's mawk is enough):
# Google Benchmark writes one JSON member per line, which is all this parser relies on.
# Several files are merged (a row found in two files keeps the first file's figures; the date
# and load are the first file's), e.g. the default run and a `--long --benchmark_filter=lsh_fused` run.
# With --benchmark_repetitions the "min" rows are used (the least disturbed run on a shared
# machine), or the median ones if there is no min.

function value(line) {
  sub(/^[^:]*:[ \t]*/, "", line)
  sub(/,[ \t]*$/, "", line)
  gsub(/"/, "", line)
  return line
}

function to_ms(time, unit) {
  if (unit == "ns") return time * 1e-6
  if (unit == "us") return time * 1e-3
  if (unit == "s") return time * 1e3
  return time
}

function has(name) { return (name in ms) }

function fmt(x) {
  if (x >= 100) return sprintf("%.0f", x)
  if (x >= 10) return sprintf("%.1f", x)
  if (x >= 1) return sprintf("%.2f", x)
  return sprintf("%.3g", x)
}

function cell(name) { return has(name) ? fmt(ms[name]) : "-" }

function target(text, measured, ok) {
  printf("| %s | %s | %s |\n", text, measured, ok ? "met" : "**not met**") > report
}

BEGIN {
  if (outdir == "") outdir = "."
  report = outdir "/poslsh_bench.md"
  split("exact_naive exact_tiled banded lsh_per_sample lsh_fused fixed_blocks", methods, " ")
  method_count = 6
}

FNR == 1 { in_runs = 0 }
/"load_avg":/ && load == "" { load = value($0); gsub(/[][]/, "", load); gsub(/,/, " ", load) }
/"date":/ && !in_runs && date == "" { date = value($0) }
/"benchmarks":/ { in_runs = 1 }
in_runs && /^[ \t]*\{/ { name = ""; kind = ""; aggregate = ""; gflop = ""; time = ""; unit = "" }
in_runs && /"run_name":/ { name = value($0) }
in_runs && /"run_type":/ { kind = value($0) }
in_runs && /"aggregate_name":/ { aggregate = value($0) }
in_runs && /"real_time":/ { time = value($0) + 0 }
in_runs && /"time_unit":/ { unit = value($0) }
in_runs && /"GFLOP":/ { gflop = value($0) + 0 }
in_runs && /^[ \t]*\}/ {
  # Rank of a row: an iteration 1, the median of repetitions 2, their minimum 3.
  rank = kind == "iteration" ? 1 : aggregate == "median" ? 2 : aggregate == "min" ? 3 : 0
  if (name != "" && rank > 0 && (!(name in best) || rank > best[name])) {
    if (!has(name)) order[++count] = name
    best[name] = rank
    ms[name] = to_ms(time, unit)
    if (rank == 1) work[name] = gflop * ms[name]  # GFLOP/s x time: the same for every run
    gflops[name] = (rank > 1 && (name in work)) ? work[name] / ms[name] : gflop
  }
}

END {
  if (count == 0) {
    print "bench_report.awk: no benchmark rows in the input" > "/dev/stderr"
    exit 1
  }
  # Data files: prefill time per method, decode time per token; flags.gp says which exist.
  has_prefill = 0
  has_decode = 0
  for (m = 1; m <= method_count; ++m) {
    file = outdir "/" methods[m] ".dat"
    printf("# n  ms  GFLOP/s  (%s)\n", methods[m]) > file
    for (r = 1; r <= count; ++r) {
      split(order[r], part, "/")
      if (part[1] != methods[m]) continue
      printf("%s %.6g %.6g\n", part[2], ms[order[r]], gflops[order[r]]) > file
      has_prefill = 1
      if (part[2] + 0 > max_n) max_n = part[2] + 0
      if (ms[order[r]] > max_ms) max_ms = ms[order[r]]
    }
    close(file)
  }
  split("decode_lsh decode_exact", decoders, " ")
  for (m = 1; m <= 2; ++m) {
    file = outdir "/" decoders[m] ".dat"
    printf("# t  us per token  (%s)\n", decoders[m]) > file
    for (r = 1; r <= count; ++r) {
      split(order[r], part, "/")
      if (part[1] != decoders[m]) continue
      printf("%s %.6g\n", part[2], ms[order[r]] * 1e3) > file
      has_decode = 1
    }
    close(file)
  }
  file = outdir "/flags.gp"
  printf("has_prefill = %d\nhas_decode = %d\nmax_n = %d\nmax_ms = %.6g\n", has_prefill, has_decode, max_n, max_ms) > file
  split(load, loads, " ")
  run_date = substr(date, 1, 16)
  sub(/T/, " ", run_date)
  printf("run_info = \"%s, load average %.1f at start\"\n", run_date, loads[1]) > file
  close(file)
  # Guides: slope 1 through lsh_fused/1024, slope 2 through exact_tiled/1024.
  file = outdir "/guide_linear.dat"
  printf("# n  ms  (slope 1)\n") > file
  for (n = 1024; n <= max_n; n *= 2) if (has("lsh_fused/1024")) print n, ms["lsh_fused/1024"] * n / 1024 > file
  close(file)
  file = outdir "/guide_quadratic.dat"
  printf("# n  ms  (slope 2)\n") > file
  for (n = 1024; n <= max_n && n <= 65536; n *= 2) if (has("exact_tiled/1024")) print n, ms["exact_tiled/1024"] * (n / 1024) ^ 2 > file
  close(file)

  # Report.
  printf("poslsh_bench, %s, load average at start %s (2 cores)\n\n", date, load) > report
  printf("Prefill, time per call in ms (float, H = 8, d = 64, causal, ALiBi sigma 2..256, s = 16):\n\n") > report
  printf("| n |") > report
  for (m = 1; m <= method_count; ++m) printf(" %s |", methods[m]) > report
  printf("\n|---|") > report
  for (m = 1; m <= method_count; ++m) printf("---|") > report
  printf("\n") > report
  for (n = 1024; n <= 1048576; n *= 2) {
    line = ""
    found = 0
    for (m = 1; m <= method_count; ++m) {
      line = line " " cell(methods[m] "/" n) " |"
      if (has(methods[m] "/" n)) found = 1
    }
    if (found) printf("| %d |%s\n", n, line) > report
  }
  printf("\nGFLOP/s at 4d FLOPs per useful pair (sgemm 2048^3: %s GFLOP/s):\n\n", has("sgemm") ? fmt(gflops["sgemm"]) : "-") > report
  printf("| n |") > report
  for (m = 1; m <= method_count; ++m) printf(" %s |", methods[m]) > report
  printf("\n|---|") > report
  for (m = 1; m <= method_count; ++m) printf("---|") > report
  printf("\n") > report
  for (n = 1024; n <= 1048576; n *= 2) {
    line = ""
    found = 0
    for (m = 1; m <= method_count; ++m) {
      key = methods[m] "/" n
      line = line " " (has(key) ? fmt(gflops[key]) : "-") " |"
      if (has(key)) found = 1
    }
    if (found) printf("| %d |%s\n", n, line) > report
  }
  printf("\nEvery head sigma = 16, n = 16384, time in ms:\n\n| s | per-sample | fused | ratio |\n|---|---|---|---|\n") > report
  split("1 4 16 64 100", sample_counts, " ")
  for (i = 1; i <= 5; ++i) {
    a = "sigma16_per_sample/" sample_counts[i]
    b = "sigma16_fused/" sample_counts[i]
    if (has(a) && has(b)) printf("| %s | %s | %s | %.1f |\n", sample_counts[i], cell(a), cell(b), ms[a] / ms[b]) > report
  }
  printf("\nDecode, one token (8 heads, one thread) over a cache of t tokens, us per token:\n\n| t | lsh | exact |\n|---|---|---|\n") > report
  for (t = 4096; t <= 1048576; t *= 2) {
    a = "decode_lsh/" t
    b = "decode_exact/" t
    if (has(a) || has(b)) printf("| %d | %s | %s |\n", t, has(a) ? fmt(ms[a] * 1e3) : "-", has(b) ? fmt(ms[b] * 1e3) : "-") > report
  }

  printf("\nTargets (issue 5):\n\n| target | measured | |\n|---|---|---|\n") > report
  if (has("exact_tiled/16384") && has("sgemm")) {
    x = gflops["exact_tiled/16384"] / gflops["sgemm"]
    target("exact_tiled/16384 >= 70% of sgemm GFLOP/s", sprintf("%.0f%% (%s of %s)", 100 * x, fmt(gflops["exact_tiled/16384"]), fmt(gflops["sgemm"])), x >= 0.70)
  }
  split("16 100", sample_targets, " ")
  split("4 15", sample_ratios, " ")
  for (i = 1; i <= 2; ++i) {
    a = "sigma16_per_sample/" sample_targets[i]
    b = "sigma16_fused/" sample_targets[i]
    if (has(a) && has(b)) {
      x = ms[a] / ms[b]
      target(sprintf("sigma16_fused >= %dx faster than per-sample at s = %s", sample_ratios[i], sample_targets[i]), sprintf("%.1fx", x), x >= sample_ratios[i])
    }
  }
  split("16384 32768", sizes, " ")
  split("20 40", size_ratios, " ")
  for (i = 1; i <= 2; ++i) {
    a = "exact_tiled/" sizes[i]
    b = "lsh_fused/" sizes[i]
    if (has(a) && has(b)) {
      x = ms[a] / ms[b]
      target(sprintf("lsh_fused >= %dx faster than exact_tiled at n = %s", size_ratios[i], sizes[i]), sprintf("%.1fx", x), x >= size_ratios[i])
    }
  }
  for (n = 16384; n <= 1048576; n *= 2) {
    b = "lsh_fused/" n
    if (has(b) && has("sgemm")) {
      x = gflops[b] / gflops["sgemm"]
      target(sprintf("lsh_fused/%d >= 50%% of sgemm GFLOP/s", n), sprintf("%.0f%% (%s)", 100 * x, fmt(gflops[b])), x >= 0.5)
    }
  }
  if (has("lsh_fused/16384") && has("lsh_fused/65536")) {
    x = ms["lsh_fused/65536"] / ms["lsh_fused/16384"]
    target("lsh_fused time(65536) / time(16384) <= 4.5", sprintf("%.2f", x), x <= 4.5)
  }
  if (has("decode_lsh/4096") && has("decode_lsh/1048576")) {
    x = ms["decode_lsh/1048576"] / ms["decode_lsh/4096"]
    target("decode_lsh per token, t = 1048576 within 2x of t = 4096", sprintf("%.2fx", x), x <= 2)
  }
  close(report)
}
