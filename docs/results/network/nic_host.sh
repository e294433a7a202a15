#!/usr/bin/env bash
# One lab host of run.sh's `nic` target: the bytes this host's NIC (eth0, headers included)
# sends during one trainer run, appended to OUT as "HOST BYTES".
#   nic_host.sh OUT HOST python -m jaxcomp.main ...
set -eu
out=$1 host=$2
shift 2
tx() { cat /sys/class/net/eth0/statistics/tx_bytes; }
before=$(tx)
"$@"
echo "$host $(($(tx) - before))" >> "$out"
