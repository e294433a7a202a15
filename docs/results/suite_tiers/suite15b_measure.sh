#!/bin/bash
# usage: measure.sh ROUNDS OUT spec...  spec = runner:FILE or loop:FILE[::K]; before=/tmp/s15b_before after=$AFTER
rounds=$1; out=$2; shift 2
for r in $(seq 1 $rounds); do
 for tree in before after; do
  d=/tmp/s15b_before; [ $tree = after ] && d=$AFTER
  for spec in "$@"; do
   mode=${spec%%:*}; f=${spec#*:}
   cd $d
   if [ $mode = runner ]; then envs="JAXCOMP_TEST_FUSION_EMITTERS=1"; args="-m user_numerics"; else envs="X=1"; args=""; fi
   /usr/bin/time -f "%U %S %e" -o /tmp/s15b_m/t.$$ env PYTHONPATH=$d $envs /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider $args $f > /tmp/s15b_m/log.$$ 2>&1
   rc=$?
   read u s e < /tmp/s15b_m/t.$$
   echo "$r $tree $mode $f rc=$rc user+sys=$(echo "$u + $s" | bc) wall=$e load=$(cut -d' ' -f1 /proc/loadavg) $(date +%H:%M:%S) $(tail -1 /tmp/s15b_m/log.$$)" >> $out
  done
 done
done
