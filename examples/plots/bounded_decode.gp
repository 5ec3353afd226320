# Plot of bounded_decode --csv output: the bounded cache's bytes against t next to the full
# cache's, for the BLOOM-7b1 and MPT-7B-StoryWriter shapes (one CSV each).
#   gnuplot -e "bloom='bloom.csv'; mpt='mpt.csv'; out='bounded_decode'" bounded_decode.gp
# writes out.png.
if (!exists("bloom")) bloom = 'bloom.csv'
if (!exists("mpt")) mpt = 'mpt.csv'
if (!exists("out")) out = 'bounded_decode'
set datafile separator ','

set logscale x 2
set logscale y 10
set format x '2^{%L}'
set format y '%g'
set xlabel 'position t'
set ylabel 'KV cache of one layer [MiB]'
set title 'One 32-head layer (d = 128, bfloat16), heads planned at 1% output error' noenhanced
set key top left box opaque
set grid xtics ytics lc rgb '#dddddd'
mib = 1024.0 * 1024.0

set terminal pngcairo size 900,560 font ',11'
set output out.'.png'
plot bloom using 1:($3 / mib) skip 1 with lines lw 2 lc rgb '#7f7f7f' title 'full cache (either shape)', \
     bloom using 1:($2 / mib) skip 1 with linespoints lw 2 pt 7 lc rgb '#1f77b4' title 'bounded: BLOOM-7b1 shape (sigma <= 256)', \
     mpt using 1:($2 / mib) skip 1 with linespoints lw 2 pt 5 lc rgb '#d62728' title 'bounded: MPT-7B-StoryWriter shape (sigma <= 65536)'
