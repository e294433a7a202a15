#!/bin/bash
# issue-13 benchmarks on an idle machine: OUT dir, REPO (default /work/main);
# ONLY="compressors ab_training ..." runs only the named ones
OUT=$1; REPO=${2:-/work/main}; mkdir -p $OUT; cd $REPO
PY=/work/main/.venv/bin/python
log() { echo "== $1 $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/run.log; }
run() { name=$1; shift; [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return; log $name; s=$(date +%s.%N); "$@" > $OUT/$name.txt 2>&1; rc=$?; echo "rc=$rc $(echo "$(date +%s.%N) - $s" | bc) s" >> $OUT/run.log; }
export PYTHONPATH=$REPO
run compressors $PY -m jaxcomp.bench compressors --json $OUT/compressors.json
run dp_feedback_keep env JAXCOMP_HOST_MALLOC=keep $PY -m jaxcomp.bench data_parallel --tables feedback --json $OUT/data_parallel_feedback_keep.json
run dp_feedback $PY -m jaxcomp.bench data_parallel --tables feedback --json $OUT/data_parallel_feedback.json
run ab_training $PY -m jaxcomp.bench ab_training --no-bytes --trainer-runs 2 --json $OUT/ab_training.json
[ -x /tmp/perf3/tv/bin/python ] && run peers /tmp/perf3/tv/bin/python -m jaxcomp.bench peers --json $OUT/peers.json
run ab_stalls_idle env RUNS=5 $PY docs/results/benchmarks_idle/after/ab_stalls.py $REPO --idle
run ab_stalls_busy $PY docs/results/benchmarks_idle/after/ab_stalls.py $REPO
run ab_stalls_idle_cache env RUNS=5 $PY docs/results/benchmarks_idle/after/ab_stalls.py $REPO --idle --cache
log end
