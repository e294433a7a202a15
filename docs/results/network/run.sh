#!/usr/bin/env bash
# The network lab's must-show cells (issue 33), one rate (or the pipeline) per call, each call
# short enough for one tools/cpu-all window:
#   tools/cpu-all docs/results/network/run.sh 100mbit      # then 1gbit, 10mbit, unlimited
#   tools/cpu-all docs/results/network/run.sh pipeline   # PIPE_RATES="10mbit" for other rates
#     (TAG=NAME: a new series of pipeline cells)
#   tools/cpu-all docs/results/network/run.sh diagnosis      # where the time goes
#   tools/cpu-all docs/results/network/run.sh pipeline-idle  # the pipeline without slow start
#   tools/cpu-all docs/results/network/run.sh pipeline-het   # boundaries of different sizes
#   tools/cpu-all docs/results/network/run.sh 2x1            # one device per host
#   tools/cpu-all docs/results/network/run.sh hier RATE      # hierarchical mesh vs flat dense
#     (ROUNDS=N rounds, default 2; TAG=NAME: cells named ...-RATE-NAME-rN, a new series;
#      PAIR=1: each cell beside its unlimited-rate twin, in the same window)
#   tools/cpu-all docs/results/network/run.sh nic [RATE [CELL...]]  # NIC bytes per step
#   tools/cpu-all docs/results/network/run.sh 10gbit         # a tbf that never limits
#   tools/cpu-all docs/results/network/run.sh gpt RATE       # the GPT on the embedded text
#   tools/cpu-all docs/results/network/run.sh gpt-pipeline RATE  # its 4-stage pipeline, 4 x 1
#     (issue 35 item 5: time to a target validation loss; language_model.md)
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

compact() {  # JSON files on one line, a cell's lab.json without the calibration's raw sweeps
  "$PY" -c 'import json, sys
for p in sys.argv[1:]:
    d = json.load(open(p))
    (d.get("calibration") or {}).pop("sweeps", None)
    open(p, "w").write(json.dumps(d, separators=(",", ":")) + "\n")' "$@"
}

keep() {  # the files the report reads, without checkpoints; per-step times gzipped
  local name=$1 src="$RUNS/$1" dst="$here/cells/$1"
  rm -rf "$dst"; mkdir -p "$dst"
  for f in lab.json summary.json metrics.jsonl experiment.json; do
    cp "$src/$f" "$dst/"
  done
  gzip -n -c "$src/timing.jsonl" > "$dst/timing.jsonl.gz"
  compact "$dst/lab.json"
}

calibrate() {  # NAME HOSTS DEVICES RATE (the probes' logs stay in $RUNS)
  local out="$here/calibrations/$1.json"
  [ -f "$out" ] && return 0
  lab calibrate --hosts "$2" --devices "$3" --rate "$4" --out "$RUNS/$1.json"
  cp "$RUNS/$1.json" "$out"
  compact "$out"
}

cell() {  # NAME VARIANT RATE CALIBRATION CONFIG [--set ...]
  local name=$1 variant=$2 rate=$3 cal=$4 config=$5
  shift 5
  [ -f "$here/cells/$name/lab.json" ] && return 0
  rm -rf "${RUNS:?}/$name"
  echo "== $name: load $(cut -d' ' -f1-3 /proc/loadavg)"
  [ "$cal" = none ] || cal="$here/calibrations/$cal.json"
  lab train --config "$config" --workdir "$RUNS/$name" --variant "$variant" \
    --hosts "$HOSTS" --devices "$DEVICES" --rate "$rate" --calibration "$cal" \
    "${TARGETS[@]}" "$@"
  keep "$name"
}

PSGD=(--set 'data_parallel.transform="compressed_mean"'
      --set 'data_parallel.codec={"name": "power_sgd", "rank": 2, "feedback": "ef"}')
TARGETS=(--target 0.97)
SHORT=(--set total_steps=60 --set eval_every=0 --set log_every=20 --set checkpoint_every=0)
PIPE_ONE=(--set 'mesh=[("stage", 4)]' --set total_steps=60 --set eval_every=20
          --set log_every=20 --set checkpoint_every=0)  # a pipeline cell, one stage per host
case "$what" in
  diagnosis)  # TCP slow start after idle gaps
    HOSTS=2 DEVICES=4
    for ss in slow-start no-slow-start; do
      flag=(); [ $ss = no-slow-start ] && flag=(--no_slow_start_after_idle)
      cell "dense-$ss-2x4-100mbit" "dense-$ss" 100mbit none configs/digits_dense.py \
        "${SHORT[@]}" "${flag[@]}"
    done
    ;;
  hier)  # PowerSGD (and Accordion) on [("slow", 2), ("fast", 4)]: dense inside a host,
    # compressed between hosts; round-robin with the flat dense cell, ROUNDS rounds (default 2,
    # the second in reverse order); each round's cells are their own variant, so the report
    # takes a cell's compute from the same round's unlimited cell; TAG=NAME names a new series
    # of cells (e.g. TAG=sharded after the hierarchical mean was sharded over fast);
    # PAIR=1 runs each cell at unlimited rate right before (after, in even rounds) the same cell
    # at RATE, so that the compute the report takes from the unlimited cell was measured in the
    # same minute as the cell it predicts (a shared machine's load drifts between windows)
    HOSTS=2 DEVICES=4
    rate=$2
    rates=("$rate")
    [ -n "${PAIR:-}" ] && rates=(unlimited "$rate")
    HIER=(--set 'mesh=[("slow", 2), ("fast", 4)]')
    if [ "$rate" = 10mbit ]; then
      LEN=(--set total_steps=60 --set eval_every=20 --set log_every=20)
    else
      LEN=(--set total_steps=300 --set eval_every=25 --set log_every=25)
    fi
    for rt in "${rates[@]}"; do calibrate "per_host-2x4-$rt" 2 4 "$rt"; done
    cells=(dense-flat powersgd-hier)
    case "$rate" in unlimited | 100mbit) cells+=(accordion-hier) ;; esac
    for r in $(seq 1 "${ROUNDS:-2}"); do
      order=("${cells[@]}")
      [ $((r % 2)) = 0 ] && order=($(printf '%s\n' "${cells[@]}" | tac))
      pair=("${rates[@]}")
      [ $((r % 2)) = 0 ] && pair=($(printf '%s\n' "${rates[@]}" | tac))
      for c in "${order[@]}"; do
        for rt in "${pair[@]}"; do
          name="$c-2x4-$rt${TAG:+-$TAG}-r$r" variant="$c${TAG:+-$TAG}-round$r"
          case "$c" in
            dense-flat) cell "$name" "$variant" "$rt" "per_host-2x4-$rt" \
              configs/digits_dense.py "${LEN[@]}" ;;
            powersgd-hier) cell "$name" "$variant" "$rt" "per_host-2x4-$rt" \
              configs/digits_accordion.py "${LEN[@]}" "${PSGD[@]}" "${HIER[@]}" ;;
            accordion-hier) cell "$name" "$variant" "$rt" "per_host-2x4-$rt" \
              configs/digits_accordion.py "${LEN[@]}" "${HIER[@]}" ;;
          esac
        done
      done
    done
    ;;
  nic)  # bytes per step through each host's NIC at RATE (default unlimited): the difference
    # between a 10-step and a 40-step run (start-up, compiling and the final evaluation cancel),
    # per host; `nic 10mbit powersgd-flat powersgd-hier` for some cells only
    rate=${2:-unlimited}
    shift $(($# > 1 ? 2 : 1))
    HIER=(--set 'mesh=[("slow", 2), ("fast", 4)]')
    QUIET=(--set eval_every=0 --set checkpoint_every=0 --set log_every=10)
    res="$here/nic_bytes-$rate.txt"
    : > "$res"
    nic_cells=("$@")
    [ ${#nic_cells[@]} = 0 ] && nic_cells=(dense-flat dense-hier powersgd-flat powersgd-hier)
    for c in "${nic_cells[@]}"; do
      case "$c" in
        dense-flat) args=(--config configs/digits_dense.py) ;;
        dense-hier) args=(--config configs/digits_dense.py "${HIER[@]}") ;;
        powersgd-flat) args=(--config configs/digits_accordion.py "${PSGD[@]}") ;;
        powersgd-hier) args=(--config configs/digits_accordion.py "${PSGD[@]}" "${HIER[@]}") ;;
      esac
      for n in 10 40; do
        w="$RUNS/nic-$c-$rate-$n"
        rm -rf "$w" "$w.tx"
        echo "== nic $c $n steps: load $(cut -d' ' -f1-3 /proc/loadavg)"
        lab run --hosts 2 --devices 4 --rate "$rate" --timeout 300 --log_dir "$w-logs" -- \
          "$here/nic_host.sh" "$w.tx" "{process_id}" "$PY" -m jaxcomp.main --workdir "$w" \
          --cpu_devices "{devices}" "${args[@]}" "${QUIET[@]}" --set total_steps=$n
        echo "$c $n $(sort "$w.tx" | tr '\n' ' ')" >> "$res"
      done
    done
    cat "$res"
    ;;
  10gbit)  # the unlimited rate with a qdisc on the NICs (tbf at 10 Gbit/s), no calibration:
    # is the hierarchical step's unlimited-rate time the link's or the missing qdisc's?
    HOSTS=2 DEVICES=4
    LEN=(--set total_steps=300 --set eval_every=25 --set log_every=25)
    cell powersgd-hier-2x4-10gbit-r1 powersgd-hier-10gbit 10gbit none \
      configs/digits_accordion.py "${LEN[@]}" "${PSGD[@]}" --set 'mesh=[("slow", 2), ("fast", 4)]'
    cell dense-flat-2x4-10gbit-r1 dense-flat-10gbit 10gbit none configs/digits_dense.py "${LEN[@]}"
    ;;
  gpt)  # the GPT of configs/text_gpt_dense.py on the embedded text (issue 35 item 5): dense on
    # the flat mesh against PowerSGD rank 4 + EF and Accordion (ranks 4/1, its config) on
    # [("slow", 2), ("fast", 4)]; same batch (64), steps, seed; time to target validation
    # losses; GPT_CELLS="..." for some cells only, GPT_STEPS for another length
    HOSTS=2 DEVICES=4
    rate=${2:-100mbit}
    HIER=(--set 'mesh=[("slow", 2), ("fast", 4)]')
    GLEN=(--set "total_steps=${GPT_STEPS:-300}" --set eval_every=25 --set log_every=25
          --set checkpoint_every=0)
    TARGETS=(--target_loss 2.4 --target_loss 2.3 --target_loss 2.2 --target_loss 2.1)
    GPSGD=(--set 'data_parallel.transform="compressed_mean"'
           --set 'data_parallel.codec={"name": "power_sgd", "rank": 4, "feedback": "ef"}')
    calibrate "per_host-2x4-$rate" 2 4 "$rate"
    for c in ${GPT_CELLS:-gpt-dense-flat gpt-powersgd-hier gpt-accordion-hier}; do
      case "$c" in
        gpt-dense-flat) cell "$c-2x4-$rate" "$c" "$rate" "per_host-2x4-$rate" \
          configs/text_gpt_dense.py "${GLEN[@]}" ;;
        gpt-powersgd-hier) cell "$c-2x4-$rate" "$c" "$rate" "per_host-2x4-$rate" \
          configs/text_gpt_accordion.py "${GLEN[@]}" "${GPSGD[@]}" "${HIER[@]}" ;;
        gpt-accordion-hier) cell "$c-2x4-$rate" "$c" "$rate" "per_host-2x4-$rate" \
          configs/text_gpt_accordion.py "${GLEN[@]}" "${HIER[@]}" ;;
        *) echo "unknown GPT cell $c" >&2; exit 2 ;;
      esac
    done
    ;;
  2x1)  # one device per host: each host's compute on its own core
    HOSTS=2 DEVICES=1
    ONE=(--set 'mesh=[("data", 2)]')
    for rate in unlimited 100mbit 10mbit; do
      calibrate "per_host-2x1-$rate" 2 1 "$rate"
      cell "dense-2x1-$rate" dense-2x1 "$rate" "per_host-2x1-$rate" configs/digits_dense.py \
        "${SHORT[@]}" "${ONE[@]}"
      cell "powersgd-2x1-$rate" powersgd-r2-ef-2x1 "$rate" "per_host-2x1-$rate" \
        configs/digits_accordion.py "${SHORT[@]}" "${ONE[@]}" "${PSGD[@]}"
    done
    ;;
  gpt-pipeline)  # the GPT pipeline of configs/text_gpt_pipeline.py, one stage per host (4 x 1):
    # its TopK 10% shared-mask links against identity links, time to target validation
    # losses (issue 35 item 5); each cell beside its unlimited twin (as hier's PAIR=1)
    HOSTS=4 DEVICES=1
    rate=${2:-100mbit}
    GPIPE=(--set 'mesh=[("stage", 4)]' --set "total_steps=${GPT_STEPS:-300}" --set eval_every=25
           --set log_every=25 --set checkpoint_every=0)
    TARGETS=(--target_loss 2.4 --target_loss 2.3 --target_loss 2.2 --target_loss 2.1)
    IDENTITY=(--set 'pipeline.forward="identity"' --set 'pipeline.backward_mode="independent"')
    for rt in unlimited "$rate"; do calibrate "per_host-4x1-$rt" 4 1 "$rt"; done
    for v in topk identity; do
      links=(); [ $v = identity ] && links=("${IDENTITY[@]}")
      for rt in unlimited "$rate"; do
        cell "gpt-pipeline-$v-4x1-$rt" "gpt-pipeline-$v" "$rt" "per_host-4x1-$rt" \
          configs/text_gpt_pipeline.py "${GPIPE[@]}" "${links[@]}"
      done
    done
    ;;
  pipeline)
    HOSTS=4 DEVICES=1
    ONE=("${PIPE_ONE[@]}")
    IDENTITY=(--set 'pipeline.forward="identity"' --set 'pipeline.backward="identity"')
    # TAG=NAME: a new series, cells ...-RATE-NAME and variants pipeline-*-NAME (TAG=tick: one
    # permute per tick and direction, docs/results/network/pipeline_model.md)
    for rate in ${PIPE_RATES:-unlimited 100mbit}; do
      calibrate "per_host-4x1-$rate" 4 1 "$rate"
      for v in ${PIPE_VARIANTS:-quantized identity}; do
        links=(); [ $v = identity ] && links=("${IDENTITY[@]}")
        cell "pipeline-$v-4x1-$rate${TAG:+-$TAG}" "pipeline-$v${TAG:+-$TAG}" "$rate" \
          "per_host-4x1-$rate" configs/digits_pipeline.py "${ONE[@]}" "${links[@]}"
      done
    done
    ;;
  pipeline-het)  # boundaries of different sizes: identity, quantize 4/8, identity
    # (docs/results/network/README.md, "Boundaries of different sizes"; PIPE_RATES and TAG as
    # above; PIPE_VARIANTS="identity" runs only the identity cells of `pipeline`)
    HOSTS=4 DEVICES=1
    ONE=("${PIPE_ONE[@]}")
    Q='{"forward": {"name": "quantize", "bits": 4, "scale": "feature"},'
    Q+=' "backward": {"name": "quantize", "bits": 8}}'
    I='{"forward": "identity", "backward": "identity"}'
    for rate in ${PIPE_RATES:-unlimited 100mbit}; do
      calibrate "per_host-4x1-$rate" 4 1 "$rate"
      cell "pipeline-het-4x1-$rate${TAG:+-$TAG}" "pipeline-het${TAG:+-$TAG}" "$rate" \
        "per_host-4x1-$rate" \
        configs/digits_pipeline.py "${ONE[@]}" --set "pipeline.boundaries=[$I, $Q, $I]"
    done
    ;;
  pipeline-idle)  # identity links at 10 Mbit/s without TCP slow start after idle
    # (docs/results/network/pipeline_model.md): does an idle link's restart cost the sends?
    HOSTS=4 DEVICES=1
    cell pipeline-identity-noidle-4x1-10mbit pipeline-identity-noidle 10mbit none \
      configs/digits_pipeline.py --set 'mesh=[("stage", 4)]' --set total_steps=60 \
      --set eval_every=20 --set log_every=20 --set checkpoint_every=0 \
      --set 'pipeline.forward="identity"' --set 'pipeline.backward="identity"' \
      --no_slow_start_after_idle
    ;;
  *)
    HOSTS=2 DEVICES=4
    rate=$what
    if [ "$rate" = 10mbit ]; then
      LEN=(--set total_steps=60 --set eval_every=20 --set log_every=20)
    else
      LEN=(--set total_steps=300 --set eval_every=25 --set log_every=25)
    fi
    for rt in "${rates[@]}"; do calibrate "per_host-2x4-$rt" 2 4 "$rt"; done
    cell "dense-2x4-$rate" dense "$rate" "per_host-2x4-$rate" configs/digits_dense.py "${LEN[@]}"
    cell "powersgd-2x4-$rate" powersgd-r2-ef "$rate" "per_host-2x4-$rate" \
      configs/digits_accordion.py "${LEN[@]}" "${PSGD[@]}"
    cell "accordion-2x4-$rate" accordion "$rate" "per_host-2x4-$rate" \
      configs/digits_accordion.py "${LEN[@]}"
    ;;
esac
echo "== done $what: load $(cut -d' ' -f1-3 /proc/loadavg)"
