#!/usr/bin/env bash
# The network lab's must-show cells (issue 33), one rate (or the pipeline) per call, each call
# short enough for one tools/cpu-all window:
#   tools/cpu-all docs/results/network/run.sh 100mbit      # then 1gbit, 10mbit, unlimited
#   tools/cpu-all docs/results/network/run.sh pipeline
# Runs go to $RUNS (default /tmp/jaxcomp-lab-runs); each finished cell's small files (lab.json,
# summary, timing and metrics) are copied into docs/results/network/cells/, which
# `python -m jaxcomp.lab report docs/results/network/cells --out docs/results/network` reads.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
PY=${PY:-python}
RUNS=${RUNS:-/tmp/jaxcomp-lab-runs}
what=$1
mkdir -p "$RUNS" "$here/cells" "$here/calibrations"
cd "$repo"
lab() { PYTHONPATH="$repo" "$PY" -m jaxcomp.lab "$@"; }

keep() {  # the files the report reads, without checkpoints
  local name=$1 src="$RUNS/$1" dst="$here/cells/$1"
  rm -rf "$dst"; mkdir -p "$dst"
  for f in lab.json summary.json timing.jsonl metrics.jsonl experiment.json; do
    cp "$src/$f" "$dst/"
  done
}

calibrate() {  # NAME HOSTS DEVICES RATE
  local out="$here/calibrations/$1.json"
  [ -f "$out" ] || lab calibrate --hosts "$2" --devices "$3" --rate "$4" --out "$out"
}

cell() {  # NAME VARIANT RATE CALIBRATION CONFIG [--set ...]
  local name=$1 variant=$2 rate=$3 cal=$4 config=$5
  shift 5
  [ -f "$here/cells/$name/lab.json" ] && return 0
  rm -rf "${RUNS:?}/$name"
  echo "== $name: load $(cut -d' ' -f1-3 /proc/loadavg)"
  lab train --config "$config" --workdir "$RUNS/$name" --variant "$variant" \
    --hosts "$HOSTS" --devices "$DEVICES" --rate "$rate" \
    --calibration "$here/calibrations/$cal.json" --target 0.97 "$@"
  keep "$name"
}

PSGD=(--set 'data_parallel.transform="compressed_mean"'
      --set 'data_parallel.codec={"name": "power_sgd", "rank": 2, "feedback": "ef"}')
case "$what" in
  pipeline)
    HOSTS=4 DEVICES=1
    ONE=(--set 'mesh=[("stage", 4)]' --set total_steps=60 --set eval_every=20
         --set log_every=20 --set checkpoint_every=0)
    IDENTITY=(--set 'pipeline.forward="identity"' --set 'pipeline.backward="identity"')
    for rate in unlimited 100mbit; do
      calibrate "per_host-4x1-$rate" 4 1 "$rate"
      cell "pipeline-quantized-4x1-$rate" pipeline-quantized "$rate" "per_host-4x1-$rate" \
        configs/digits_pipeline.py "${ONE[@]}"
      cell "pipeline-identity-4x1-$rate" pipeline-identity "$rate" "per_host-4x1-$rate" \
        configs/digits_pipeline.py "${ONE[@]}" "${IDENTITY[@]}"
    done
    ;;
  *)
    HOSTS=2 DEVICES=4
    rate=$what
    if [ "$rate" = 10mbit ]; then
      LEN=(--set total_steps=60 --set eval_every=20 --set log_every=20)
    else
      LEN=(--set total_steps=300 --set eval_every=25 --set log_every=25)
    fi
    calibrate "per_host-2x4-$rate" 2 4 "$rate"
    cell "dense-2x4-$rate" dense "$rate" "per_host-2x4-$rate" configs/digits_dense.py "${LEN[@]}"
    cell "powersgd-2x4-$rate" powersgd-r2-ef "$rate" "per_host-2x4-$rate" \
      configs/digits_accordion.py "${LEN[@]}" "${PSGD[@]}"
    cell "accordion-2x4-$rate" accordion "$rate" "per_host-2x4-$rate" \
      configs/digits_accordion.py "${LEN[@]}"
    ;;
esac
echo "== done $what: load $(cut -d' ' -f1-3 /proc/loadavg)"
