#!/bin/bash
# usage: census.sh DEVICES OUT.json CONFIG [--set K=V ...]   (from the repository root)
dev=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
py=${PY:-/work/main/.venv/bin/python}
for i in 0 1; do
  JAX_PLATFORMS=cpu PYTHONPATH=$PWD timeout 600 $py "$here/census.py" $i $port $dev "$out" "$@" > "$out.$i.log" 2>&1 &
done
wait
