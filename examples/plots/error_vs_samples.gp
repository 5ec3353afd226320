# Log-log plot of error_vs_samples --csv output: spectral and max-norm error of M~ against s,
# with their fitted slopes (over s >= 4), s^-1/2 reference lines and the paper's expectation bound.
#   gnuplot -e "csv='error_vs_samples.csv'; out='error_vs_samples'" error_vs_samples.gp
# writes out.svg and out.png. Plots head 0 of the CSV.
if (!exists("csv")) csv = 'error_vs_samples.csv'
if (!exists("out")) out = 'error_vs_samples'
set datafile separator ','

# Header values of head 0: n, sigma, masking (column 4 is text, read through a string test).
stats csv using ($1 == 0 ? $3 : NaN) nooutput
n = STATS_max
stats csv using ($1 == 0 ? $2 : NaN) nooutput
sigma = STATS_max
stats csv using (($1 == 0 && strcol(4) eq 'causal') ? 1 : 0) nooutput
causal = STATS_max
# Least-squares slopes of log error against log s over s >= 4, and reference lines c s^-1/2
# through the geometric mean of those points.
stats csv using (($1 == 0 && $6 >= 4) ? log($6) : NaN):(log($7)) nooutput
spectral_slope = STATS_slope
spectral_c = exp(STATS_mean_y + 0.5 * STATS_mean_x)
stats csv using (($1 == 0 && $6 >= 4) ? log($6) : NaN):(log($8)) nooutput
max_slope = STATS_slope
max_c = exp(STATS_mean_y + 0.5 * STATS_mean_x)

set logscale x 2
set logscale y 10
set format y '%g'
set xlabel 'samples s'
set ylabel 'error'
set title sprintf('Error of the LSH estimate M~ of the ALiBi kernel L* (n = %d, sigma = %g, %s)', \
                  n, sigma, causal > 0.5 ? 'causal' : 'bidirectional') noenhanced
set key bottom left noenhanced box opaque
set grid xtics ytics mxtics mytics lc rgb '#dddddd'
set xrange [*:*]
set offsets graph 0.02, graph 0.02, graph 0.05, graph 0.05

set terminal svg size 900,600 dynamic font 'sans,13' background rgb 'white'
set output out.'.svg'
plot csv using ($1 == 0 ? $6 : NaN):10 with lines dt 3 lw 2 lc rgb '#999999' title 'paper bound on E||L* - M~||_2', \
     csv using ($1 == 0 ? $6 : NaN):7 with linespoints pt 7 ps 1.1 lw 2 lc rgb '#1f77b4' title sprintf('||L* - M~||_2 (spectral), slope %.2f', spectral_slope), \
     spectral_c / sqrt(x) with lines dt 2 lw 1.5 lc rgb '#1f77b4' title 'reference slope -1/2', \
     csv using ($1 == 0 ? $6 : NaN):8 with linespoints pt 5 ps 1.0 lw 2 lc rgb '#d62728' title sprintf('max |L* - M~| (max norm), slope %.2f', max_slope), \
     max_c / sqrt(x) with lines dt 2 lw 1.5 lc rgb '#d62728' title 'reference slope -1/2'

set terminal pngcairo size 900,600 font 'sans,11' background rgb 'white'
set output out.'.png'
replot
set output
