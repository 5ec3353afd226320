# poslsh benchmarks: log-log scaling plot from the data files of bench_report.awk.
#   gnuplot -e "datadir='DIR'; output='scaling.png'" plot_scaling.gp
# Left: prefill time per call against n for every method. Right: decode time per token
# against the cache length t. The output's extension picks the terminal (.png or .svg).

if (!exists("datadir")) datadir = "."
if (!exists("output")) output = "scaling.png"
load datadir."/flags.gp"

if (output[strlen(output)-3:] eq ".svg") {
  set terminal svg size 1400,700 dynamic enhanced font "sans,13"
} else {
  set terminal pngcairo size 1400,700 enhanced font "sans,13"
}
set output output

set logscale xy
set logscale x 2
set format x "2^{%L}"
set format y "10^{%T}"
set grid xtics ytics lc rgb "#dddddd" lw 1
set key top left reverse Left samplen 2 spacing 1.1 opaque
set border lw 1.2

set style line 1 lc rgb "#555555" lw 2 pt 4 ps 1.2   # exact_naive
set style line 2 lc rgb "#d62728" lw 2 pt 5 ps 1.2   # exact_tiled
set style line 3 lc rgb "#ff7f0e" lw 2 pt 9 ps 1.3   # banded
set style line 4 lc rgb "#9467bd" lw 2 pt 11 ps 1.3  # lsh_per_sample
set style line 5 lc rgb "#1f77b4" lw 3 pt 7 ps 1.3   # lsh_fused
set style line 6 lc rgb "#2ca02c" lw 2 pt 13 ps 1.3  # fixed_blocks
set style line 7 lc rgb "#999999" lw 1.5 dt 2        # guides

set multiplot layout 1,2 title "poslsh: float, H = 8, d = 64, causal, ALiBi {/Symbol s} = 2..256, s = 16; 2 cores, ".run_info font ",14"

set title "Prefill: time per call"
set xlabel "sequence length n"
set ylabel "time (ms)"
set xrange [768:(max_n > 1024 ? max_n : 1024) * 1.35]
set yrange [*:max_ms * 150]  # room for the key above the slowest row
if (has_prefill) {
  plot datadir."/exact_naive.dat" using 1:2 with linespoints ls 1 title "exact naive", \
       datadir."/exact_tiled.dat" using 1:2 with linespoints ls 2 title "exact tiled", \
       datadir."/banded.dat" using 1:2 with linespoints ls 3 title "exact banded ({/Symbol e} = 10^{-3})", \
       datadir."/lsh_per_sample.dat" using 1:2 with linespoints ls 4 title "LSH per-sample", \
       datadir."/lsh_fused.dat" using 1:2 with linespoints ls 5 title "LSH fused", \
       datadir."/fixed_blocks.dat" using 1:2 with linespoints ls 6 title "fixed blocks", \
       datadir."/guide_quadratic.dat" using 1:2 with lines ls 7 title "slopes 2 and 1", \
       datadir."/guide_linear.dat" using 1:2 with lines ls 7 notitle
} else {
  set label 1 "no prefill rows" at graph 0.5, 0.5 center
  set yrange [1:10]
  plot 0.1 notitle
  unset label 1
  set autoscale y
}

set title "Decode: one token (8 heads) over a cache of t tokens"
set xlabel "cache length t"
set ylabel "time per token ({/Symbol m}s)"
set xrange [3000:1400000]
set autoscale y
if (has_decode) {
  plot datadir."/decode_exact.dat" using 1:2 with linespoints ls 2 title "exact", \
       datadir."/decode_lsh.dat" using 1:2 with linespoints ls 5 title "LSH (s = 16)"
} else {
  set label 1 "no decode rows" at graph 0.5, 0.5 center
  set yrange [1:10]
  plot 0.1 notitle
}

unset multiplot
