#!/bin/bash
for r in 1 2; do for t in /tmp/oldtree /work/main; do
  cd $t; echo "== $t r$r $(git log --oneline -1 | cut -c1-8) $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$t /work/main/.venv/bin/python -m jaxcomp.bench ab_training --models mlp_digits --sync-modes with-stale --no-bytes --rows-per-worker 16 2>&1 | grep -E "^mlp_digits" | awk '{print $3, $(NF-2), $(NF-3), $(NF-4)}'
done; done
