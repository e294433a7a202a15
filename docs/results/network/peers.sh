#!/usr/bin/env bash
# Issue 33 item 5 and the AB cell: jaxcomp against torch DDP (gloo) on the same lab links, and
# AB-Training against data parallelism, round-robin, one call per rate (each fits one
# tools/cpu-all window):
#   tools/cpu-all docs/results/network/peers.sh unlimited     # then 100mbit, 10mbit
#   tools/cpu-all docs/results/network/peers.sh ab [RATE]     # digits_ab vs digits_dense (100mbit)
#   tools/cpu-all docs/results/network/peers.sh 2x1 RATE     # both sides as 2 hosts x 1 rank of 64
# ROUNDS (default 2) rounds; round r runs the cells in order, round r+1 in reverse. Cells go to
# docs/results/network/peers/NAME-rROUND/ (jaxcomp's: lab.json, summary, metrics, timing;
# torch's: summary.json, timing), each with cell.json (command, load before and after);
# `python docs/results/network/peers_table.py` prints the tables of peers.md. The persistent
# compilation cache is off (no --compile_cache, JAXCOMP_COMPILE_CACHE unset).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
PY=${PY:-python}
RUNS=${RUNS:-/tmp/jaxcomp-lab-runs/peers}
ROUNDS=${ROUNDS:-2}
what=$1
unset JAXCOMP_COMPILE_CACHE
out="$here/peers"
mkdir -p "$RUNS" "$out"
cd "$repo"
lab() { PYTHONPATH="$repo" "$PY" -m jaxcomp.lab "$@"; }
LAYOUT=2x4
NET=(--hosts 2 --devices 4)

record() {  # NAME RATE LOAD_BEFORE COMMAND...: cell.json beside the kept files
  local name=$1 rate=$2 before=$3
  shift 3
  "$PY" -c 'import json, os, shlex, sys
name, rate, before, path = sys.argv[1:5]
rec = {"name": name, "rate": rate, "load_before": [float(x) for x in before.split()],
       "load_after": [round(x, 2) for x in os.getloadavg()], "command": shlex.join(sys.argv[5:])}
open(path, "w").write(json.dumps(rec) + "\n")' "$name" "$rate" "$before" "$out/$name/cell.json" "$@"
}

jax_cell() {  # NAME RATE CONFIG [--set ...]
  local name=$1 rate=$2 config=$3 before
  shift 3
  [ -f "$out/$name/cell.json" ] && return 0
  rm -rf "${RUNS:?}/$name" "${out:?}/$name"
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "== $name: load $before"
  lab train --config "$config" --workdir "$RUNS/$name" "${NET[@]}" --rate "$rate" \
    --calibration none --variant "${name%-r*}" "$@"
  mkdir -p "$out/$name"
  for f in lab.json summary.json metrics.jsonl experiment.json; do cp "$RUNS/$name/$f" "$out/$name/"; done
  gzip -n -c "$RUNS/$name/timing.jsonl" > "$out/$name/timing.jsonl.gz"
  record "$name" "$rate" "$before" lab train --config "$config" "${NET[@]}" --rate "$rate" "$@"
}

torch_cell() {  # NAME RATE HOOK STEPS
  local name=$1 rate=$2 hook=$3 steps=$4 before
  [ -f "$out/$name/cell.json" ] && return 0
  rm -rf "${RUNS:?}/$name" "${out:?}/$name"
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "== $name: load $before"
  local peer=("$PY" -m jaxcomp.lab._torch_peer --hook "$hook" --steps "$steps")
  lab run "${NET[@]}" --rate "$rate" --timeout 600 --log_dir "$RUNS/$name/logs" -- \
    "${peer[@]}" --out "$RUNS/$name"
  mkdir -p "$out/$name"
  cp "$RUNS/$name/summary.json" "$out/$name/"
  gzip -n -c "$RUNS/$name/timing.jsonl" > "$out/$name/timing.jsonl.gz"
  record "$name" "$rate" "$before" lab run "${NET[@]}" --rate "$rate" -- "${peer[@]}"
}

PSGD=(--set 'data_parallel.transform="compressed_mean"'
      --set 'data_parallel.codec={"name": "power_sgd", "rank": 2, "feedback": "ef"}')
QUIET=(--set eval_every=0 --set checkpoint_every=0 --set log_every=20)

cells=()
case "$what" in
  ab)
    rate=${2:-100mbit}
    LEN=(--set total_steps=300 "${QUIET[@]}")
    cells=("jax ab configs/digits_ab.py ${LEN[*]}" "jax dp-dense configs/digits_dense.py ${LEN[*]}")
    ;;
  unlimited | 1gbit | 100mbit | 10mbit | 2x1)
    rate=$what
    if [ "$what" = 2x1 ]; then
      rate=$2 LAYOUT=2x1 NET=(--hosts 2 --devices 1)
    fi
    steps=60
    [ "$rate" = 10mbit ] && steps=30
    LEN=(--set total_steps=$steps "${QUIET[@]}")
    [ "$LAYOUT" = 2x1 ] && LEN+=(--set 'mesh=[("data", 2)]')
    cells=("jax dense configs/digits_dense.py ${LEN[*]@Q}"
           "torch torch-dense dense $steps"
           "jax powersgd configs/digits_accordion.py ${LEN[*]@Q} ${PSGD[*]@Q}"
           "torch torch-powersgd powersgd $steps")
    ;;
  *)
    echo "usage: $0 unlimited|1gbit|100mbit|10mbit|ab [RATE]|2x1 RATE" >&2
    exit 2
    ;;
esac

for r in $(seq 1 "$ROUNDS"); do
  order=("${cells[@]}")
  if [ $((r % 2)) = 0 ]; then
    order=()
    for ((i = ${#cells[@]} - 1; i >= 0; i--)); do order+=("${cells[i]}"); done
  fi
  for c in "${order[@]}"; do
    eval "set -- $c"
    side=$1 label=$2
    shift 2
    if [ "$side" = jax ]; then
      jax_cell "$label-$LAYOUT-$rate-r$r" "$rate" "$@"
    else
      torch_cell "$label-$LAYOUT-$rate-r$r" "$rate" "$@"
    fi
  done
done
echo "== done $what: load $(cut -d' ' -f1-3 /proc/loadavg)"
