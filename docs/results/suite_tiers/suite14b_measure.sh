#!/bin/bash
# usage: measure.sh ROUNDS OUTFILE spec...   spec = runner:FILE or loop:FILE
# alternates before (/tmp/s14b) and after (/tmp/s14b_after), one pytest process per file, in one held slot
rounds=$1; out=$2; shift 2
for r in $(seq 1 $rounds); do
 for tree in before after; do
  d=/tmp/s14b; [ $tree = after ] && d=/tmp/s14b_after
  for spec in "$@"; do
   mode=${spec%%:*}; f=${spec#*:}
   cd $d
   if [ $mode = runner ]; then envs="JAXCOMP_TEST_FUSION_EMITTERS=1"; args="-m user_numerics"; else envs="X=1"; args=""; fi
   [ -f $f ] || { echo "$r $tree $mode $f missing" >> $out; continue; }
   /usr/bin/time -f "%U %S %e" -o /tmp/s14b_m/t.$$ env PYTHONPATH=$d $envs /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider $args $f > /tmp/s14b_m/log.$$ 2>&1
   rc=$?
   read u s e < /tmp/s14b_m/t.$$
   echo "$r $tree $mode $f rc=$rc user+sys=$(echo "$u + $s" | bc) wall=$e load=$(cut -d' ' -f1 /proc/loadavg) $(date +%H:%M:%S) $(tail -1 /tmp/s14b_m/log.$$)" >> $out
  done
 done
done
