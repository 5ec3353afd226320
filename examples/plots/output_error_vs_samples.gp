# Log-log plot of output_error_vs_samples --csv output: relative output error ||T* - T~||_F / ||T*||_F
# against s, one panel per data set, for the LSH kernels (per-sample and fused give the same
# estimator), fixed blocks and banded attention at the fused kernel's pair budget, the paper's
# fixed blocks of width 2 sigma (grey) and an s^-1/2 line through the fused points (s >= 4).
#   gnuplot -e "csv='output_error_vs_samples.csv'; out='output_error_vs_samples'" output_error_vs_samples.gp
# writes out.svg and out.png; `datasets` lists the data sets of the CSV to draw (one panel each).
if (!exists("csv")) csv = 'output_error_vs_samples.csv'
if (!exists("out")) out = 'output_error_vs_samples'
if (!exists("datasets")) datasets = 'random smooth heavy'
set datafile separator ','
# Rows of the other methods and data sets lie between the points of one curve: skip them
# without breaking its line.
set datafile missing NaN

# Columns: 1 data, 2 n, 3 d, 4 sigma, 5 masking, 8 s, 9 method, 11 pairs per query, 15 relative
# Frobenius error.
stats csv using 2 nooutput
n = STATS_max
stats csv using 4 nooutput
sigma = STATS_max
stats csv using ((strcol(5) eq 'causal') ? 1 : 0) nooutput
causal = STATS_max
is(data, method) = strcol(1) eq data && strcol(9) eq method

set logscale x 2
set logscale y 10
set format y '%g'
set ytics (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 50)
set xlabel 'samples s' offset 0,0.3
set key below horizontal maxrows 3 width -3 samplen 2 height 1.5 noenhanced font ',10'
set grid xtics ytics mytics lc rgb '#dddddd'
set autoscale yfix
set offsets graph 0.03, graph 0.03, graph 0.08, graph 0.08

do for [format in 'svg png'] {
  if (format eq 'svg') {
    set terminal svg size 1500,640 dynamic font 'sans,13' background rgb 'white'
  } else {
    set terminal pngcairo size 1500,640 font 'sans,11' background rgb 'white'
  }
  set output out.'.'.format
  set multiplot layout 1, words(datasets) \
      title sprintf('Relative attention output error ||T* - T~||_F / ||T*||_F at equal pairs per query (n = %d, sigma = %g, %s)', \
                    n, sigma, causal > 0.5 ? 'causal' : 'bidirectional') noenhanced
  do for [i = 1:words(datasets)] {
    data = word(datasets, i)
    stats csv using (is(data, 'fused') && $8 >= 4 ? log($8) : NaN):(log($15)) nooutput
    slope = STATS_slope
    c = exp(STATS_mean_y + 0.5 * STATS_mean_x)
    stats csv using (is(data, 'fixed_2sigma') ? $15 : NaN) nooutput
    paper_fixed = STATS_max
    set title data noenhanced
    set ylabel (i == 1 ? 'relative error' : '')
    plot csv using (is(data, 'fused') ? $8 : NaN):15 with linespoints pt 7 ps 1.1 lw 2 lc rgb '#1f77b4' \
           title sprintf('LSH fused, slope %.2f', slope), \
         csv using (is(data, 'per_sample') ? $8 : NaN):15 with points pt 6 ps 1.8 lc rgb '#17becf' \
           title 'LSH per-sample (same T~)', \
         c / sqrt(x) with lines dt 2 lw 1.5 lc rgb '#1f77b4' title 'c s^-1/2', \
         csv using (is(data, 'fixed') ? $8 : NaN):15 with linespoints pt 5 ps 1.0 lw 2 lc rgb '#d62728' \
           title 'fixed blocks, same pairs', \
         csv using (is(data, 'banded') ? $8 : NaN):15 with linespoints pt 9 ps 1.2 lw 2 lc rgb '#2ca02c' \
           title 'banded, same pairs', \
         paper_fixed with lines dt 3 lw 2 lc rgb '#999999' title 'fixed blocks, W = 2 sigma'
  }
  unset multiplot
}
set output
