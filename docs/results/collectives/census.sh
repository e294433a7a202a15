#!/bin/bash
# The collectives of a config's compiled programs, as 2 jax.distributed processes x DEVICES
# (gloo, loopback): one short run through the trainer's CLI with XLA's HLO dump on, then
# census.py tabulates process 0's optimised programs into OUT/census.json.
#   docs/results/collectives/census.sh DEVICES OUT CONFIG [--set K=V ...]   (from the repo root)
set -eu
dev=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
py=${PY:-/work/main/.venv/bin/python}
port=$($py -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
rm -rf "$out"; mkdir -p "$out"
short=(--set total_steps=1 --set eval_every=0 --set checkpoint_every=0 --set log_every=1)
pids=()
for i in 0 1; do
  XLA_FLAGS="--xla_dump_to=$out/hlo$i --xla_dump_hlo_as_text" JAX_PLATFORMS=cpu PYTHONPATH=$PWD \
    timeout 900 "$py" -m jaxcomp.main --config "$1" --workdir "$out/run$i" --cpu_devices "$dev" \
    --num_processes 2 --process_id $i --coordinator_address "127.0.0.1:$port" \
    "${short[@]}" "${@:2}" > "$out/process$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$py" "$here/census.py" "$out/hlo0" "$1 ${*:2}" > "$out/census.json"
