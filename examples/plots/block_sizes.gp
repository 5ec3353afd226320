# Plot of block_sizes --csv output: mean largest block b_max against n for each sigma, with the
# sigma ln ln n scale of Theorem 2.1 (dashed, same colour).
#   gnuplot -e "csv='block_sizes.csv'; out='block_sizes'; sigmas='4 16 64'" block_sizes.gp
# writes out.svg and out.png; `sigmas` lists the sigma values of the CSV to draw.
if (!exists("csv")) csv = 'block_sizes.csv'
if (!exists("out")) out = 'block_sizes'
if (!exists("sigmas")) sigmas = '4 16 64'
set datafile separator ','

set logscale x 2
set logscale y 2
set format x '2^{%L}'
set format y '%g'
set xlabel 'sequence length n'
set ylabel 'block size'
set title 'Largest block over s = ceil(ln n) samples (mean of the trials) against sigma ln ln n' noenhanced
set key bottom right box opaque
set grid xtics ytics lc rgb '#dddddd'
set offsets graph 0.03, graph 0.03, graph 0.1, graph 0.45
colors = '#1f77b4 #d62728 #2ca02c #9467bd #ff7f0e #8c564b'

do for [format in 'svg png'] {
  if (format eq 'svg') {
    set terminal svg size 900,600 dynamic enhanced font 'sans,13' background rgb 'white'
  } else {
    set terminal pngcairo size 900,600 enhanced font 'sans,11' background rgb 'white'
  }
  set output out.'.'.format
  plot for [i = 1:words(sigmas)] csv using ($1 == real(word(sigmas, i)) ? $2 : NaN):5 \
         with linespoints pt 7 lw 2 lc rgb word(colors, i) title sprintf('b_{max}, {/Symbol s} = %s', word(sigmas, i)), \
       for [i = 1:words(sigmas)] csv using ($1 == real(word(sigmas, i)) ? $2 : NaN):7 \
         with lines dt 2 lw 1.5 lc rgb word(colors, i) title sprintf('{/Symbol s} ln ln n, {/Symbol s} = %s', word(sigmas, i))
}
set output
