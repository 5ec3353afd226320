# poslsh benchmarks: log-log scaling plot from the data files of bench_report.py.
#   gnuplot -e "datadir='DIR'; output='scaling.png'" plot_scaling.gp
# Left: prefill time per call against n for every method. Right: decode time per token
# against the cache length t. The output's extension picks the terminal (.png or .svg).

if (!exists("datadir")) datadir = "."
if (!exists("output")) output = "scaling.png"
load datadir."/plot.gp"  # has_prefill, has_decode, max_n, max_ms, run_info, line styles,
                         # prefill_plot and decode_plot (one line per method or decoder)

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

set multiplot layout 1,2 title "poslsh: float, H = 8, d = 64, causal, ALiBi {/Symbol s} = 2..256, s = 16; ".run_info font ",14"

set title "Prefill: time per call"
set xlabel "sequence length n"
set ylabel "time (ms)"
set xrange [768:(max_n > 1024 ? max_n : 1024) * 1.35]
set yrange [*:max_ms * 150]  # room for the key above the slowest row
if (has_prefill) {
  eval prefill_plot
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
  eval decode_plot
} else {
  set label 1 "no decode rows" at graph 0.5, 0.5 center
  set yrange [1:10]
  plot 0.1 notitle
}

unset multiplot
