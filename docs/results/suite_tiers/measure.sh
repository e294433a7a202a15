#!/bin/bash
# usage: BEFORE=DIR AFTER=DIR measure.sh ROUNDS OUTFILE spec...   spec = runner:FILE or loop:FILE
# Alternates the trees BEFORE and AFTER (checkouts of the two revisions), one pytest process per
# file (runner: the user_numerics tests with the fusion emitters), run in one held slot
# (tools/cpu-slot); appends "round tree mode file rc user+sys wall load time summary" to OUTFILE.
# suite14b ran it with BEFORE=/tmp/s14b AFTER=/tmp/s14b_after, suite15b with BEFORE=/tmp/s15b_before.
: "${BEFORE:?set BEFORE}" "${AFTER:?set AFTER}"
rounds=$1; out=$2; shift 2
tmp=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
 for tree in before after; do
  d=$BEFORE; [ $tree = after ] && d=$AFTER
  for spec in "$@"; do
   mode=${spec%%:*}; f=${spec#*:}
   cd "$d" || exit 1
   if [ "$mode" = runner ]; then envs="JAXCOMP_TEST_FUSION_EMITTERS=1"; args="-m user_numerics"; else envs="X=1"; args=""; fi
   [ -f "${f%%::*}" ] || { echo "$r $tree $mode $f missing" >> "$out"; continue; }
   /usr/bin/time -f "%U %S %e" -o "$tmp/t" env PYTHONPATH="$d" $envs /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider $args "$f" > "$tmp/log" 2>&1
   rc=$?
   read -r u s e < "$tmp/t"
   echo "$r $tree $mode $f rc=$rc user+sys=$(echo "$u + $s" | bc) wall=$e load=$(cut -d' ' -f1 /proc/loadavg) $(date +%H:%M:%S) $(tail -1 "$tmp/log")" >> "$out"
  done
 done
done
rm -rf "$tmp"
