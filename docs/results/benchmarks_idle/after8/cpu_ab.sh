#!/bin/bash
# alternated old/new digits_ab/dense runs, 300 steps: process user+sys CPU and wall
for r in 1 2 3 4; do for side in old new; do
  t=$([ $side = old ] && echo /tmp/s13start || echo /work/main)
  for cfg in digits_ab digits_dense; do
    rm -rf /tmp/xc; cd $t
    /usr/bin/time -f "$cfg $side r$r user %U sys %S wall %e" env PYTHONPATH=$t /work/main/.venv/bin/python -m jaxcomp.main --config configs/$cfg.py --workdir /tmp/xc --set total_steps=300 > /dev/null 2>> /tmp/lead/cpu_ab.log
  done
done; done
